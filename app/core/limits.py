"""How large a request may be: MAX_REQUEST_BYTES, or derived from the signatures served.

The HTTP body limit (app/http/bodies.py) and gRPC's message limit are this one value.
"""

from __future__ import annotations

import math

from app.core.models import STRING, LoadedModel, Signature
from app.core.registry import ModelRegistry
from app.ops.settings import Settings

# The derived MAX_REQUEST_BYTES: the longest JSON a valid request can be. A number written
# as a float64 in full is at most 24 characters with its comma ("-1.1754943508222875e-38,"),
# an int64 21; 32 leaves room for spaces and brackets. Each row of the row format repeats
# the input names as keys.
NUMBER_WIDTH = 32
NAME_OVERHEAD = 8  # quotes, colon, braces, comma and a space around a key
BODY_OVERHEAD = 64 * 1024  # "signature_name", the outer keys, whitespace
# String inputs (and dimensions of any size) have no length a signature can bound.
UNBOUNDED_INPUT_BYTES = 16 * 1024 * 1024


def derived_max_request_bytes(model: LoadedModel | Signature, max_rows: int) -> int:
    """The largest body a valid request to `model` (or one signature) can need, at most `max_rows` rows."""
    per_row = 0
    for spec in model.inputs:
        if spec.dtype == STRING or any(dim is None for dim in spec.shape):
            return UNBOUNDED_INPUT_BYTES
        elements = math.prod(dim for dim in spec.shape if dim is not None)
        per_row += elements * NUMBER_WIDTH + len(spec.name) + NAME_OVERHEAD
    return max_rows * per_row + BODY_OVERHEAD


def max_request_bytes(settings: Settings, registry: ModelRegistry) -> int:
    """MAX_REQUEST_BYTES, or derived from the models loaded at start (a later version keeps it)."""
    if settings.max_request_bytes:
        return settings.max_request_bytes
    # Every signature of every version served: :classify and other signatures take bodies too.
    return max(derived_max_request_bytes(servable.model.signatures[key], batcher.info.max_request_rows)
               for servable in registry.servables()
               for key, batcher in servable.batchers.items())
