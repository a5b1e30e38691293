"""A request's priority, as each wire format carries it.

The Open Inference Protocol's request parameter `priority` (REST: a JSON number in the body's
"parameters"; gRPC: an InferParameter, uint64 as Triton takes it, or int64), and for the TF
Serving APIs, which have no field for it, the HTTP header or gRPC metadata key `x-priority`.
Its value is a level of the model's (1 is the highest); 0, none given, or a level the model does
not have means the model's default level, as in Triton. Anything else is a 400 /
INVALID_ARGUMENT that names it. app/ops/queue_policy.py reads the levels from MODEL_CONFIG.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.core.errors import BadRequest
from app.ops.numerals import whole_number

HEADER = "X-Priority"
METADATA_KEY = HEADER.lower()  # gRPC metadata keys are lowercase
MAX_PRIORITY = 2**64 - 1  # uint64, as Triton reads it
PARAMETER_ERROR = f"the parameter 'priority' must be a whole number from 0 to {MAX_PRIORITY} (1 is the highest level)"
HEADER_ERROR = f"the {HEADER} header must be a whole number from 0 to {MAX_PRIORITY} (1 is the highest level)"


def from_v2_rest(parameters: Mapping[str, Any]) -> int:
    """The `priority` of a v2 REST request's parameters; 0 without one."""
    value = parameters.get("priority", 0)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise BadRequest(PARAMETER_ERROR)
    return value


def from_v2_grpc(parameters: Any) -> int:
    """The `priority` InferParameter of a v2 gRPC request (uint64_param or int64_param); 0 without one."""
    if "priority" not in parameters:
        return 0
    parameter = parameters["priority"]
    choice = parameter.WhichOneof("parameter_choice")
    if choice not in ("uint64_param", "int64_param") or getattr(parameter, choice) < 0:
        raise BadRequest(PARAMETER_ERROR)
    return int(getattr(parameter, choice))


def from_header(value: str | None) -> int:
    """The `X-Priority` header (or `x-priority` metadata) of a TF Serving API request; 0 without one."""
    if value is None:
        return 0
    level = whole_number(value.strip(), MAX_PRIORITY)
    if level is None:
        raise BadRequest(HEADER_ERROR)
    return level


def from_metadata(metadata: Any) -> int:
    """The `x-priority` key of a gRPC call's invocation metadata (the last one given); 0 without one."""
    value = None
    for key, item in metadata or ():
        if key == METADATA_KEY:
            value = item
    return from_header(None if value is None else str(value))
