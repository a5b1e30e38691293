"""Triton's model configuration extension: a served model as Triton's `ModelConfig` describes one.

`GET /v2/models/{m}[/versions/{v}]/config` and gRPC `ModelConfig` answer the fields this server
has, under Triton's names (model_config.proto): `name`, `platform` (`tensorflow_savedmodel`),
`backend` (`tensorflow`), `max_batch_size` (0 for a signature served unbatched), `input` and
`output` of the `serving_default` signature (`data_type` TYPE_*, `dims` without the batch
dimension, -1 where any size goes), `version_policy` (TF Serving's model_version_policy, which
has Triton's shape) and `dynamic_batching`: `preferred_batch_size` (the batch sizes calls are
padded to), `max_queue_delay_microseconds` (BATCH_TIMEOUT_MS), the priority levels and each
level's queue policy (`max_queue_size` in rows). REST writes the message as Triton does
(model_config_utils.cc, ModelConfigToJson): every scalar and list field, defaults included,
64-bit numbers as JSON numbers.
"""

from __future__ import annotations

from typing import Any

from app.core.batching import bucket_sizes
from app.core.models import TensorInfo
from app.core.registry import Servable
from app.wire.v2_tensors import BYTES, datatype

# The fields of ModelConfig that are 64-bit numbers: protobuf's JSON writes them as strings.
_INT64_FIELDS = frozenset(("dims", "shape", "versions", "max_queue_delay_microseconds", "priority_levels",
                           "default_priority_level", "default_timeout_microseconds"))


def model_config(servable: Servable, entry: dict[str, Any] | None) -> dict[str, Any]:
    """The ModelConfig of a served version, in protobuf's JSON names; `entry` its MODEL_CONFIG entry
    (app/core/registry.py's config_entry), None where the registry has none (its batcher's limits then)."""
    model = servable.model
    signature = model.signatures[model.default_signature]
    info = servable.batchers[signature.name].info
    batched = not info.whole
    config: dict[str, Any] = {
        "name": model.name, "platform": "tensorflow_savedmodel", "backend": "tensorflow",
        "max_batch_size": info.max_batch_size if batched else 0,
        "input": [_tensor(spec, batched) for spec in signature.inputs],
        "output": [_tensor(spec, batched) for spec in signature.outputs],
    }
    if entry is not None:
        config["version_policy"] = entry["model_version_policy"]
    if batched:
        config["dynamic_batching"] = _dynamic_batching(info.max_batch_size, info.batch_timeout_s, entry)
    return config


def _tensor(spec: TensorInfo, batched: bool) -> dict[str, Any]:
    name = datatype(spec)
    data_type = "TYPE_STRING" if name == BYTES else f"TYPE_{name}" if not name.startswith("DT_") else "TYPE_INVALID"
    if spec.dims is None:
        dims: list[int] = [-1]
    else:
        dims = [-1 if size is None else size for size in (spec.shape if batched else spec.dims)]
    return {"name": spec.name, "data_type": data_type, "dims": dims}


def _dynamic_batching(max_batch_size: int, timeout_s: float, entry: dict[str, Any] | None) -> dict[str, Any]:
    batching: dict[str, Any] = {"preferred_batch_size": list(bucket_sizes(max_batch_size)),
                                "max_queue_delay_microseconds": round(timeout_s * 1e6)}
    if entry is None:
        return batching
    batching["default_queue_policy"] = {"max_queue_size": entry["max_queue_rows"]}
    levels = entry.get("priority_levels")
    if levels:
        batching.update(priority_levels=levels, default_priority_level=entry["default_priority_level"],
                        priority_queue_policy=entry["priority_queue_policy"])
    return batching


def config_message(config: dict[str, Any]) -> Any:
    """The config as tritonclient's `inference.ModelConfig` message (gRPC's answer)."""
    # Imported here: the HTTP door needs protobuf only for this route.
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    return json_format.ParseDict(config, model_config_pb2.ModelConfig())


def config_json(config: dict[str, Any]) -> dict[str, Any]:
    """The config as Triton's REST answer writes it: every field printed, 64-bit numbers as numbers."""
    from google.protobuf import json_format

    written = json_format.MessageToDict(config_message(config), preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=True)
    return _numbers(written)


def _numbers(value: Any, key: str = "") -> Any:
    if isinstance(value, dict):
        return {name: _numbers(item, name) for name, item in value.items()}
    if isinstance(value, list):
        return [_numbers(item, key) for item in value]
    if key in _INT64_FIELDS and isinstance(value, str):
        return int(value)
    return value
