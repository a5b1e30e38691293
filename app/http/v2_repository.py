"""Triton's model repository extension over HTTP (app/core/repository.py does the work).

    POST /v2/repository/index                 every model of MODEL_REPOSITORY and every model served
    POST /v2/repository/models/{m}/load       serve MODEL_REPOSITORY/m
    POST /v2/repository/models/{m}/unload     stop serving m

RESTRICTED_MODEL_CONTROL's header is checked before each of them.
"""

from __future__ import annotations

from typing import Any

import orjson
from flask import Blueprint, Flask, Response, request

from app.core.errors import BadRequest
from app.http.routes import services
from app.wire import codec

bp = Blueprint("v2_repository", __name__, url_prefix="/v2/repository")


@bp.before_request
def restricted() -> None:
    repository = services().repository
    repository.check(request.path, request.headers.get(repository.key) if repository.key else None,
                     where="header")


def _body() -> dict[str, Any]:
    data = request.get_data()
    body = codec.loads(data) if data else {}  # whitespace alone is not JSON: refused as Triton refuses it
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object")
    return body


def _rest_parameters() -> dict[str, Any]:
    parameters = _body().get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be a JSON object")
    return parameters


@bp.post("/index")
def index() -> Response:
    ready = _body().get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest("'ready' must be true or false")
    return Response(orjson.dumps(services().repository.index(ready=ready)), content_type="application/json")


@bp.post("/models/<model_name:name>/load")
def load(name: str) -> Response:
    services().repository.load(name, _rest_parameters(), timeout_s=None)
    return Response(b"", content_type="application/json")


@bp.post("/models/<model_name:name>/unload")
def unload(name: str) -> Response:
    services().repository.unload(name, _rest_parameters(), timeout_s=None)
    return Response(b"", content_type="application/json")


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
