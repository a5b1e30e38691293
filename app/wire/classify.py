"""TensorFlow Serving's :classify and :regress in JSON: tf.Examples in, results out.

Which signature, its checks and the shape of the results are the request layer's
(app/core/serving.py); this module reads and writes the JSON.

Request, as TF Serving reads it (util/json_tensor.cc, FillClassifyRegressRequestFromJson):
{"signature_name": "...", "context": {feature: value|list}, "examples": [{feature: value|list}, ...]}.
A JSON integer is an int64 feature, a number with a fraction or exponent a float feature,
a string or {"b64": ...} a bytes feature. Context features are merged into each example,
as TF Serving serializes an ExampleListWithContext.

Answer (MakeJsonFromClassificationResult / MakeJsonFromRegressionResult):
classify: {"results": [[[label, score], ...], ...]}; regress: {"results": [value, ...]}.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from app.core.batching import check_rows
from app.core.errors import BadRequest, InvalidInput
from app.core.serving import Classes
from app.wire import codec


def parse(body: bytes, method: str) -> tuple[str, Callable[[int], np.ndarray]]:
    """The signature name asked for ('' if none), and what builds one serialized tf.Example per
    example once the limit is known: more examples than its `max_rows` are refused before any is built."""
    document = codec.parse_json(body)
    if not isinstance(document, dict):
        raise BadRequest(f"the request body must be a JSON object, not {codec._json_type(document)}")
    signature_name = document.get("signature_name", "")
    if not isinstance(signature_name, str):
        raise BadRequest("'signature_name' key must be a string value.")
    context = _features(document["context"], "context") if "context" in document else {}
    if "examples" not in document:
        raise BadRequest(f"When method is {method}, key 'examples' is expected and was not found")
    examples = document["examples"]
    if not isinstance(examples, list):
        raise BadRequest("Expecting 'examples' value to be an list/array")
    if not examples:
        raise BadRequest("'examples' value is an empty array")
    return signature_name, lambda max_rows: _serialize(examples, context, max_rows)


def _serialize(examples: list[Any], context: dict[str, Any], max_rows: int) -> np.ndarray:
    from tensorflow.core.example import example_pb2

    check_rows(len(examples), max_rows, unit="examples")
    serialized = np.empty(len(examples), dtype=object)
    for index, value in enumerate(examples):
        example = example_pb2.Example()
        for name, feature in {**context, **_features(value, f"examples[{index}]")}.items():
            example.features.feature[name].CopyFrom(feature)
        serialized[index] = example.SerializeToString()
    return serialized


def _features(value: Any, where: str) -> dict[str, Any]:
    from tensorflow.core.example import feature_pb2

    if not isinstance(value, dict) or codec._is_b64(value):
        raise InvalidInput(f"{where}: Example must be JSON object but got JSON {codec._json_type(value)}")
    features = {}
    for name, content in value.items():
        items = content if isinstance(content, list) else [content]
        kinds = {_kind(item, name, where) for item in items}
        if len(kinds) > 1:
            raise InvalidInput(f"{where}: feature '{name}' mixes {' and '.join(sorted(kinds))} values; "
                               "a feature holds one kind (a number with a fraction is a float)")
        feature = feature_pb2.Feature()
        kind = kinds.pop() if kinds else "float"
        if kind == "bytes":
            feature.bytes_list.value.extend(_bytes(item, name, where) for item in items)
        elif kind == "int64":
            if any(not -2**63 <= item < 2**63 for item in items):
                raise InvalidInput(f"{where}: Feature: {name} has an integer outside int64. Only int64 is supported.")
            feature.int64_list.value.extend(items)
        else:
            feature.float_list.value.extend(items)
        features[name] = feature
    return features


def _kind(item: Any, name: str, where: str) -> str:
    if isinstance(item, bool) or item is None or isinstance(item, list) or (
            isinstance(item, dict) and not codec._is_b64(item)):
        raise InvalidInput(f"{where}: Feature: {name} has element with unexpected JSON type: "
                           f"{codec._json_type(item)}")
    if isinstance(item, int):
        return "int64"
    if isinstance(item, float):
        return "float"
    return "bytes"


def _bytes(item: Any, name: str, where: str) -> bytes:
    if isinstance(item, str):
        return item.encode()
    try:
        return base64.b64decode(item["b64"], validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise InvalidInput(f"{where}: feature '{name}': a 'b64' value is not valid base64") from None


def encode_classes(classes: Classes) -> bytes:
    results = [[[label, score] for label, score in zip(labels, scores, strict=True)]
               for labels, scores in zip(classes.labels, classes.scores, strict=True)]
    return orjson.dumps({"results": results}, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_regressions(values: np.ndarray) -> bytes:
    return orjson.dumps({"results": values}, option=orjson.OPT_SERIALIZE_NUMPY)
