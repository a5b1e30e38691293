"""Triton's statistics extension of the Open Inference Protocol, over HTTP and gRPC.

    GET /v2/models/stats                                every version of every model served
    GET /v2/models/{m}/stats                            every version of one model
    GET /v2/models/{m}/versions/{v}/stats               one version (digits) or a version label's
    rpc inference.GRPCInferenceService/ModelStatistics  the same, by `name` and `version`

The figures come from app/model_stats.py. As Triton answers: a model not served is refused
with INVALID_ARGUMENT (HTTP 400), "requested model 'm' is not available"; a version not
served with "requested model version is not available for model 'm'".
"""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from flask import Response, current_app
from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from app import model_stats, v2_tensors
from app.errors import BadRequest
from app.logs import RequestRecord
from app.metrics import Metrics, get_metrics
from app.registry import ModelRegistry
from app.serving import RequestLayer, get_layer


def statistics(registry: ModelRegistry, metrics: Metrics | None, name: str = "", version: str = "") -> dict[str, Any]:
    """Triton's statistics response for a model (all if '') and version (all if '')."""
    if not name:
        chosen = sorted((servable.model.name, servable.model.version) for servable in registry.servables())
        return {"model_stats": model_stats.read(metrics, chosen)}
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
    return {"model_stats": model_stats.read(metrics, [(name, number) for number in numbers])}


def all_models_view() -> Response:
    return model_view("")


def model_view(name: str, version: str = "") -> Response:
    layer = get_layer(current_app)
    body = statistics(layer.registry, get_metrics(current_app), name, version)
    return Response(orjson.dumps(body), content_type="application/json")


def grpc_handler(layer: RequestLayer) -> Any:
    """ModelStatistics for `InferenceServicer` (app/grpc_calls.py maps its errors to codes)."""

    def model_statistics(request: Any, record: RequestRecord, context: grpc.ServicerContext) -> Any:
        record.model = request.name or None
        # No app here: under Gunicorn the counts are read from the multiprocess files alone.
        body = statistics(layer.registry, None, request.name, request.version)
        return json_format.ParseDict(body, service_pb2.ModelStatisticsResponse(), ignore_unknown_fields=True)

    return model_statistics
