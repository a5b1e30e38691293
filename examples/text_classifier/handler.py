"""A text model's handler: a tokenizer in preprocess, a batch key on the "temperature" parameter,
and the model's custom Keras layer named for loading.

    MODEL_PATH=examples/models/text_classifier.keras MODEL_HANDLER=examples.text_classifier.handler \
        .venv/bin/gunicorn -c gunicorn.conf.py wsgi:app
    curl -d '{"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["fresh milk"]}],
              "parameters": {"temperature": 0.5}}' localhost:8000/v2/models/default/infer

Only the v2 doors carry request parameters; TF Serving's requests get temperature 1.0. This
module imports numpy and the standard library only: the Keras layer is imported by
`custom_objects()`, which the server calls only in the process that loads the model.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np

VOCABULARY = 1000  # token ids 1..999; 0 pads
MAX_TOKENS = 32
LABELS = ("dairy", "fruit", "vegetable", "bakery")
_LABELS = np.array([label.encode() for label in LABELS], dtype=object)
_WORD = re.compile(r"[a-z0-9']+")

signature = {
    "inputs": {"text": {"dtype": "bytes", "shape": []}},
    "outputs": {"label": {"dtype": "bytes", "shape": []},
                "probabilities": {"dtype": "float32", "shape": [len(LABELS)]}},
}


def custom_objects() -> dict[str, Any]:
    """The model's custom Keras objects, by registered name; called where the model loads, before it."""
    from examples.text_classifier.layers import Scale

    return {"text_example>Scale": Scale}


def tokens(text: bytes) -> list[int]:
    """Lower-cased words as ids (a stable hash of each), at most MAX_TOKENS; ValueError if none."""
    try:
        words = _WORD.findall(text.decode("utf-8").lower())[:MAX_TOKENS]
    except UnicodeDecodeError as exc:  # a ValueError: the client's 400
        raise ValueError(f"text is not UTF-8: {exc}") from None
    if not words:
        raise ValueError("text holds no words")
    return [1 + zlib.crc32(word.encode()) % (VOCABULARY - 1) for word in words]


def temperature(parameters: dict[str, Any]) -> float:
    value = parameters.get("temperature", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.05 <= value <= 20:
        raise ValueError(f"parameter 'temperature' must be a number from 0.05 to 20; got {value!r}")
    return float(value)


def batch_key(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> float:
    """Rows share a predict call only with rows of the same temperature (the Scale layer reads one)."""
    return temperature(parameters)


def preprocess(inputs: dict[str, np.ndarray], parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each text as token ids, padded with 0 to the request's longest; the temperature on every row."""
    rows = [tokens(text) for text in inputs["text"]]
    ids = np.zeros((len(rows), max(map(len, rows))), dtype=np.int32)
    for index, row in enumerate(rows):
        ids[index, :len(row)] = row
    return {"tokens": ids, "temperature": np.full((len(rows), 1), temperature(parameters), dtype=np.float32)}


def postprocess(outputs: dict[str, np.ndarray], inputs: dict[str, np.ndarray],
                parameters: dict[str, Any]) -> dict[str, np.ndarray]:
    probabilities = outputs["probabilities"]
    return {"label": _LABELS[np.argmax(probabilities, axis=1)], "probabilities": probabilities.astype(np.float32)}
