"""TensorFlow Serving's PredictionLog record of one sampled prediction (the payload log's files).

app/ops/payload_log.py samples and writes; this builds the record's bytes from its Entry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from app.core.model_types import STRING
from app.ops.payload_log import Entry
from app.wire.tensor_proto import from_ndarray


def record(entry: Entry) -> bytes:
    """The serialized PredictionLog of `entry` (PayloadLog's `to_record`)."""
    return bytes(prediction_log(entry).SerializeToString())


def prediction_log(entry: Entry) -> Any:
    """The PredictionLog TF Serving writes for a predict: request, response and metadata."""
    from tensorflow_serving.apis import prediction_log_pb2

    record = prediction_log_pb2.PredictionLog()
    metadata = record.log_metadata
    for spec in (metadata.model_spec, record.predict_log.request.model_spec,
                 record.predict_log.response.model_spec):
        spec.name = entry.model_name
        spec.version.value = entry.version
        spec.signature_name = entry.signature_name
    metadata.sampling_config.sampling_rate = entry.rate
    metadata.saved_model_tags.append("serve")
    metadata.timestamp_secs = int(entry.timestamp)
    # Raw tensor_content, as tf.make_tensor_proto writes it: the same values, many times cheaper than
    # the typed fields for large tensors (strings stay in string_val).
    for name, array in entry.inputs.items():
        from_ndarray(array, entry.tf_dtypes.get(name, _tf_dtype(array)), record.predict_log.request.inputs[name],
                     tensor_content=True)
    for name, array in entry.outputs.items():
        from_ndarray(array, entry.tf_dtypes.get(name, _tf_dtype(array)), record.predict_log.response.outputs[name],
                     tensor_content=True)
    return record


def _tf_dtype(array: np.ndarray) -> str:
    if array.dtype == STRING:
        return "DT_STRING"
    from tensorflow.core.framework import types_pb2

    names = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "bool": "DT_BOOL", "float16": "DT_HALF"}
    name = names.get(array.dtype.name, f"DT_{array.dtype.name.upper()}")
    return name if name in types_pb2.DataType.keys() else "DT_STRING"
