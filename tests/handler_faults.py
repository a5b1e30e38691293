"""A handler with faults on request, around the text example (examples/text_classifier), for the
error tests of tests/test_handler_server.py: what a text asks for is what its handler does.

    b"bad"           preprocess raises ValueError                -> 400 with its message
    b"crash"         preprocess raises KeyError                  -> 500 with the request id
    b"crash after"   postprocess raises RuntimeError             -> 500; its batch-mates answered
    b"wrong shape"   postprocess returns one row too few         -> 500 naming the tensor
    b"slow N"        preprocess sleeps N seconds first           -> the call's deadline still holds
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from examples.text_classifier import handler as text

signature = text.signature
custom_objects = text.custom_objects
batch_key = text.batch_key


def preprocess(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    for value in inputs["text"]:
        if value == b"bad":
            raise ValueError("the text 'bad' is refused")
        if value == b"crash":
            raise KeyError("no such key")
        if value.startswith(b"slow "):
            time.sleep(float(value.split()[1]))
    return text.preprocess(inputs, parameters)


def postprocess(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    answer = text.postprocess(outputs, inputs, parameters)
    if b"crash after" in list(inputs["text"]):
        raise RuntimeError("postprocess failed on purpose")
    if b"wrong shape" in list(inputs["text"]):
        return {name: value[1:] for name, value in answer.items()}
    return answer
