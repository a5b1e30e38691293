"""Triton's model repository extension over HTTP (app/core/repository.py does the work).

    POST /v2/repository/index                 every model of MODEL_REPOSITORY and every model served
    POST /v2/repository/models/{m}/load       serve MODEL_REPOSITORY/m
    POST /v2/repository/models/{m}/unload     stop serving m

RESTRICTED_MODEL_CONTROL's header is checked before each of them.
"""

from __future__ import annotations

from typing import Any

import orjson

from app.core.errors import BadRequest
from app.core.repository import Repository, expected_parameter
from app.core.services import Services
from app.http.layers import HttpExchange
from app.http.routes import Reply, Route
from app.wire import codec


def index(services: Services, exchange: HttpExchange) -> Reply:
    repository = _restricted(services.repository, exchange)
    ready = _body(exchange).get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest("'ready' must be true or false")
    return Reply(orjson.dumps(repository.index(ready=ready)))


def load(services: Services, exchange: HttpExchange, name: str) -> Reply:
    _restricted(services.repository, exchange).load(name, _parameters(exchange, "load"),
                                                    timeout_s=services.layer.deadline_s())
    return Reply(b"")


def unload(services: Services, exchange: HttpExchange, name: str) -> Reply:
    _restricted(services.repository, exchange).unload(name, _parameters(exchange, "unload"),
                                                      timeout_s=services.layer.deadline_s())
    return Reply(b"")


ROUTES = [
    Route("POST", "/v2/repository/index", index),
    Route("POST", "/v2/repository/models/<model_name:name>/load", load),
    Route("POST", "/v2/repository/models/<model_name:name>/unload", unload),
]


def _restricted(repository: Repository, exchange: HttpExchange) -> Repository:
    """The repository, once the call came with RESTRICTED_MODEL_CONTROL's header (Forbidden if not)."""
    if repository.key:
        # The header as request.headers reads it from the environ.
        sent = exchange.environ.get("HTTP_" + repository.key.upper().replace("-", "_"))
        repository.check(exchange.path, repository.header_values(sent), where="header")
    return repository


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
