"""Triton's model repository extension over HTTP (app/core/repository.py does the work).

    POST /v2/repository/index                 every model of MODEL_REPOSITORY and every model served
    POST /v2/repository/models/{m}/load       serve MODEL_REPOSITORY/m
    POST /v2/repository/models/{m}/unload     stop serving m

Their category is Triton's `model-repository` (RESTRICTED_MODEL_CONTROL, HTTP_RESTRICTED_API).
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from app.core.errors import BadRequest
from app.core.repository import expected_parameter
from app.core.services import Services
from app.http.layers import HttpExchange
from app.http.routes import Reply, Route
from app.wire import codec
from app.wire.restricted import MODEL_REPOSITORY

# Triton's words (http_server.cc, HandleRepositoryIndex).
NOT_A_BOOLEAN = "Invalid value for 'ready': expected a boolean"
# A body whose 'ready' is an array: refused as not a boolean however deep it nests (orjson stops
# at 1024 levels; Triton's parser reads any depth, then refuses the value).
_READY_ARRAY = re.compile(rb'\s*\{\s*"ready"\s*:\s*\[')


def index(services: Services, exchange: HttpExchange) -> Reply:
    try:
        ready = _body(exchange).get("ready", False)
    except BadRequest:
        if _READY_ARRAY.match(exchange.body or b""):
            raise BadRequest(NOT_A_BOOLEAN) from None
        raise
    if not isinstance(ready, bool):
        raise BadRequest(NOT_A_BOOLEAN)
    return Reply(orjson.dumps(services.repository.index(ready=ready)))


def load(services: Services, exchange: HttpExchange, name: str) -> Reply:
    services.repository.load(name, _parameters(exchange, "load"), timeout_s=services.layer.deadline_s())
    return Reply(b"")


def unload(services: Services, exchange: HttpExchange, name: str) -> Reply:
    services.repository.unload(name, _parameters(exchange, "unload"), timeout_s=services.layer.deadline_s())
    return Reply(b"")


ROUTES = [
    Route("POST", "/v2/repository/index", index, category=MODEL_REPOSITORY),
    Route("POST", "/v2/repository/models/<model_name:name>/load", load, category=MODEL_REPOSITORY),
    Route("POST", "/v2/repository/models/<model_name:name>/unload", unload, category=MODEL_REPOSITORY),
]


def _body(exchange: HttpExchange) -> dict[str, Any]:
    data = exchange.body
    body = codec.loads(data) if data else {}  # whitespace alone is not JSON: refused as Triton refuses it
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object")
    return body


def _parameters(exchange: HttpExchange, call: str) -> dict[str, Any]:
    parameters = _body(exchange).get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be a JSON object")
    for name, value in parameters.items():
        expected = expected_parameter(call, name)
        if expected is None or type(value) is expected[0]:
            continue
        # Triton's words (http_server.cc, HandleRepositoryControl, and TritonJson's).
        if expected[0] is bool:
            raise BadRequest(f"Unable to parse '{name}': attempt to access JSON non-boolean as boolean")
        raise BadRequest("attempt to access JSON non-string as string")
    return parameters
