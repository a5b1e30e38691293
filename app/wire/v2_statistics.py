"""Triton's statistics extension of the Open Inference Protocol: which versions a request names,
with Triton's refusals; the figures are app/core/model_stats.py's.

    GET /v2/models/stats                                every version of every model served
    GET /v2/models/{m}/stats                            every version of one model
    GET /v2/models/{m}/versions/{v}/stats               one version (digits) or a version label's
    rpc inference.GRPCInferenceService/ModelStatistics  the same, by `name` and `version`
"""

from __future__ import annotations

from typing import Any

from app.core.errors import BadRequest
from app.core.model_stats import read
from app.core.registry import ModelRegistry
from app.ops.metrics import Metrics
from app.wire import v2_tensors


def statistics(registry: ModelRegistry, metrics: Metrics | None, name: str = "", version: str = "") -> dict[str, Any]:
    """Triton's statistics response for a model (all if '') and version (all if ''): a version of
    digits names a version, any other a label. As Triton answers: a model not served is refused
    with INVALID_ARGUMENT (HTTP 400), "requested model 'm' is not available"; a version not served
    with "requested model version is not available for model 'm'"."""
    if not name:
        chosen = sorted((servable.model.name, servable.model.version) for servable in registry.servables())
        return {"model_stats": read(metrics, chosen)}
    served = registry.versions(name)
    if not served:
        raise BadRequest(f"requested model '{name}' is not available")
    if not version:
        numbers = served
    elif version.isascii() and version.isdigit():
        numbers = [v2_tensors.version_number(version)]
    else:
        numbers = [registry.get(name, label=version).model.version]  # a label: refused as everywhere in v2
    if not set(numbers) <= set(served):
        raise BadRequest(f"requested model version is not available for model '{name}'")
    return {"model_stats": read(metrics, [(name, number) for number in numbers])}
