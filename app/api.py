"""HTTP routes: predict (a shortcut and TensorFlow Serving's URLs) and health."""

from __future__ import annotations

import os

import orjson
from flask import Blueprint, Flask, Response, current_app, g, request
from werkzeug.routing import BaseConverter

from app import codec, metadata, runtime
from app.errors import UnsupportedMediaType
from app.registry import Servable, get_registry
from app.settings import MODEL_NAME_PATTERN

bp = Blueprint("api", __name__)


class ModelNameConverter(BaseConverter):
    # Stops at ':' so that '/v1/models/<name>:predict' parses; the name never reaches a path.
    regex = MODEL_NAME_PATTERN.pattern.strip("^$")


def _json(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status=status, mimetype="application/json", headers=headers)


def _predict(servable: Servable) -> Response:
    """Parse, queue, wait, answer: the request thread never touches TensorFlow."""
    if request.mimetype != "application/json":
        raise UnsupportedMediaType(
            f"send the body as JSON with 'Content-Type: application/json' (got {request.mimetype or 'none'!r})"
        )
    g.model = servable.model.name
    inputs, fmt = codec.decode_request(request.get_data(cache=False), servable.model)
    g.rows = next(iter(inputs.values())).shape[0]
    settings = current_app.extensions["settings"]
    servable, result = get_registry(current_app).predict(servable, inputs,
                                                         timeout_s=settings.request_timeout_ms / 1000.0)
    g.batch_rows, g.batch_requests = result.batch_rows, result.batch_requests
    body = codec.encode_response(result.outputs, servable.model, fmt)
    return _json(body, headers={
        "X-Batch-Size": str(result.batch_rows),
        "X-Batch-Requests": str(result.batch_requests),
        "X-Model-Version": str(servable.model.version),
    })


@bp.post("/predict")
def predict_default() -> Response:
    return _predict(get_registry(current_app).get())


@bp.post("/v1/models/<model_name:name>:predict")
def predict_model(name: str) -> Response:
    return _predict(get_registry(current_app).get(name))


@bp.post("/v1/models/<model_name:name>/versions/<int:version>:predict")
def predict_version(name: str, version: int) -> Response:
    return _predict(get_registry(current_app).get(name, version))


@bp.get("/v1/models/<model_name:name>")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>")
def model_status(name: str, version: int | None = None) -> Response:
    servable = get_registry(current_app).get(name, version)
    status = {
        "version": str(servable.model.version),
        "state": "AVAILABLE" if servable.batcher.alive else "UNKNOWN",
        "status": {"error_code": "OK", "error_message": ""},
    }
    return _json(orjson.dumps({"model_version_status": [status]}))


@bp.get("/v1/models/<model_name:name>/metadata")
@bp.get("/v1/models/<model_name:name>/versions/<int:version>/metadata")
def model_metadata(name: str, version: int | None = None) -> Response:
    return _json(orjson.dumps(metadata.describe(get_registry(current_app).get(name, version).model)))


@bp.get("/healthz")
def healthz() -> Response:
    # Liveness: a worker whose batch thread died is replacing itself; until it is gone it is not alive.
    broken = sorted(name for name, servable in get_registry(current_app).items() if servable.batcher.broken)
    if broken:
        return _json(orjson.dumps({"error": f"the batch thread of model(s) {broken} died"}), status=503)
    return _json(b'{"status":"alive"}')


@bp.get("/readyz")
def readyz() -> Response:
    registry = get_registry(current_app)
    ready = registry.ready
    body = {
        "ready": ready,
        "pid": os.getpid(),
        "tensorflow": runtime.configured(),
        "models": {name: servable.status() for name, servable in registry.items()},
    }
    return _json(orjson.dumps(body), status=200 if ready else 503)


def init_app(app: Flask) -> None:
    app.url_map.converters["model_name"] = ModelNameConverter
    app.register_blueprint(bp)
