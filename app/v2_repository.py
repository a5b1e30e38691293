"""Triton's model repository extension of the Open Inference Protocol, over HTTP and gRPC.

    POST /v2/repository/index                 every model of MODEL_REPOSITORY and every model served,
                                              with each version's state (READY, LOADING, UNLOADING,
                                              UNAVAILABLE and its reason); {"ready": true}: READY only
    POST /v2/repository/models/{m}/load       serve MODEL_REPOSITORY/m (a base folder of numbered versions)
    POST /v2/repository/models/{m}/unload     stop serving m

and gRPC's RepositoryIndex, RepositoryModelLoad and RepositoryModelUnload of
inference.GRPCInferenceService. Load and unload change the server's model config as TF Serving's
HandleReloadConfigRequest does, by the same path (ModelRegistry.edit_config; with MODEL_PROCESSES,
the model processes apply it): every model process and worker has applied it before the call
answers, within the call's deadline (REST: REQUEST_TIMEOUT_MS; gRPC: the client's, as
HandleReloadConfigRequest). A model that fails to load is answered with its reason, and listed
UNAVAILABLE with it, while the others go on. They are refused (503, UNAVAILABLE, Triton's words)
unless MODEL_CONTROL_MODE is explicit. Each parameter Triton reads is type-checked, in Triton's
words on each door; then every load parameter, and any other unload one, is refused.

RESTRICTED_MODEL_CONTROL=key=value restricts these calls and HandleReloadConfigRequest to callers
that send header (or gRPC metadata key) `key` with that value, as Triton's `--http-restricted-api`
and `--grpc-restricted-protocol` do; anyone else gets 403 or PERMISSION_DENIED, and one warning
line that names the call and the key, never a value.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
from flask import Blueprint, Flask, Response, current_app, request
from tritonclient.grpc import service_pb2

from app import codec
from app.errors import BadRequest, Forbidden, NotFound, Unavailable
from app.registry import AVAILABLE, END, LOADING, UNLOADING, ConfigEdit, ModelRegistry, get_registry
from app.serving import get_layer
from app.settings import MODEL_NAME_PATTERN, Settings

log = logging.getLogger(__name__)

_SERVICE = "/inference.GRPCInferenceService"
# The calls RESTRICTED_MODEL_CONTROL guards on gRPC (REST: the blueprint's routes).
RESTRICTED_METHODS = frozenset({f"{_SERVICE}/RepositoryIndex", f"{_SERVICE}/RepositoryModelLoad",
                                f"{_SERVICE}/RepositoryModelUnload",
                                "/tensorflow.serving.ModelService/HandleReloadConfigRequest"})
# TF Serving's version states as Triton's index names them.
_STATES = {AVAILABLE: "READY", LOADING: "LOADING", UNLOADING: "UNLOADING", END: "UNAVAILABLE"}

bp = Blueprint("v2_repository", __name__, url_prefix="/v2/repository")


class Repository:
    """MODEL_REPOSITORY and the registry it changes, for both front doors."""

    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self.folder = Path(settings.model_repository) if settings.model_repository else None
        self.explicit = settings.model_control_mode == "explicit"
        key, _, value = settings.restricted_model_control.partition("=")
        self.key, self._value = key, value.encode()
        self._registry = registry

    def check(self, call: str, sent: list[str], *, where: str) -> None:
        """Refuse `call` unless it came with the restriction's key, every time with its value (`sent`:
        the values it had, in order): a key sent twice is let in only if both are the value."""
        if not self.key or (sent and all(hmac.compare_digest(value.encode(), self._value) for value in sent)):
            return
        log.warning("refused %s: no valid '%s' %s", call, self.key, where)
        raise Forbidden(f"This API is restricted, expecting {where} '{self.key}'")

    def header_values(self, text: str | None) -> list[str]:
        """The values of the restriction's header. The WSGI server joins a repeated header's with ','
        (Gunicorn; Werkzeug's test client ', '): the text is one value where it is the restriction's
        (which may hold a ','), else each of its parts is one."""
        if text is None:
            return []
        if hmac.compare_digest(text.encode(), self._value):
            return [text]
        return [part.strip(" \t") for part in text.split(",")]

    def index(self, *, ready: bool) -> list[dict[str, str]]:
        registry = self._registry
        names = {name for name, _ in registry.items()}
        if self.folder is not None and self.folder.is_dir():
            names.update(entry.name for entry in os.scandir(self.folder)
                         if entry.is_dir() and MODEL_NAME_PATTERN.fullmatch(entry.name))
        models = []
        for name in sorted(names):
            try:
                statuses = registry.model_status(name)
            except NotFound:  # in the folder, never loaded: Triton lists its name only
                statuses = []
            if not statuses and not ready:
                models.append({"name": name})
            for status in sorted(statuses, key=lambda entry: int(entry["version"])):
                state = _STATES.get(status["state"], "UNKNOWN")
                if ready and state != "READY":
                    continue
                reason = status["status"]["error_message"] or ("unloaded" if state == "UNAVAILABLE" else "")
                models.append({"name": name, "version": status["version"], "state": state, "reason": reason})
        return models

    def load(self, name: str, parameters: dict[str, Any], *, timeout_s: float | None) -> None:
        self._control(parameters, allowed=())
        assert self.folder is not None  # the settings ask for it with MODEL_CONTROL_MODE=explicit
        path = self.folder / name
        if not MODEL_NAME_PATTERN.fullmatch(name) or not path.is_dir():
            raise BadRequest(f"failed to load '{name}', failed to poll from model repository: no folder "
                             f"'{name}' in MODEL_REPOSITORY")
        try:
            self._registry.edit_config(ConfigEdit(name, str(path)), timeout_s=timeout_s)
        except BadRequest as exc:
            raise BadRequest(f"failed to load '{name}': {exc.message}") from None

    def unload(self, name: str, parameters: dict[str, Any], *, timeout_s: float | None) -> None:
        # No model depends on another here: unload_dependents has nothing more to unload.
        self._control(parameters, allowed=("unload_dependents",))
        if not self._registry.versions(name):
            return  # as Triton: unloading what is not served succeeds
        self._registry.edit_config(ConfigEdit(name), timeout_s=timeout_s)

    def _control(self, parameters: dict[str, Any], *, allowed: tuple[str, ...]) -> None:
        if not self.explicit:
            # Triton's words and status when its model control mode is not explicit.
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled")
        unknown = sorted(set(parameters) - set(allowed))
        if unknown:
            raise BadRequest(f"parameter(s) {unknown} not supported: a model is loaded from its folder in "
                             "MODEL_REPOSITORY as it is")


# The parameters Triton's repository extension reads, by call: the JSON type REST takes and the
# ModelRepositoryParameter field gRPC takes. A name ending in ':' is a prefix (`file:<path>`).
_PARAMETERS: dict[str, dict[str, tuple[type, str]]] = {
    "load": {"config": (str, "string_param"), "file:": (str, "bytes_param")},
    "unload": {"unload_dependents": (bool, "bool_param")},
}


def _expected(call: str, name: str) -> tuple[type, str] | None:
    known = _PARAMETERS[call]
    return known.get(name) or next((kind for prefix, kind in known.items()
                                    if prefix.endswith(":") and name.startswith(prefix)), None)


def get(app: Flask) -> Repository:
    repository = app.extensions.get("v2_repository")
    if repository is None:  # made at first use: the routes may be registered in an app without models
        repository = app.extensions["v2_repository"] = Repository(app.extensions["settings"], get_registry(app))
    return repository


# -- REST ---------------------------------------------------------------------------------


@bp.before_request
def restricted() -> None:
    repository = get(current_app)
    if repository.key:
        repository.check(request.path, repository.header_values(request.headers.get(repository.key)),
                         where="header")


def _body() -> dict[str, Any]:
    data = request.get_data()
    body = codec.loads(data) if data else {}  # whitespace alone is not JSON: refused as Triton refuses it
    if not isinstance(body, dict):
        raise BadRequest("the request must be a JSON object")
    return body


def _rest_parameters(call: str) -> dict[str, Any]:
    parameters = _body().get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be a JSON object")
    for name, value in parameters.items():
        expected = _expected(call, name)
        if expected is None or type(value) is expected[0]:
            continue
        # Triton's words (http_server.cc, HandleRepositoryControl, and TritonJson's).
        if expected[0] is bool:
            raise BadRequest(f"Unable to parse '{name}': attempt to access JSON non-boolean as boolean")
        raise BadRequest("attempt to access JSON non-string as string")
    return parameters


@bp.post("/index")
def index() -> Response:
    ready = _body().get("ready", False)
    if not isinstance(ready, bool):
        raise BadRequest("'ready' must be true or false")
    return Response(orjson.dumps(get(current_app).index(ready=ready)), content_type="application/json")


@bp.post("/models/<model_name:name>/load")
def load(name: str) -> Response:
    get(current_app).load(name, _rest_parameters("load"), timeout_s=get_layer(current_app).deadline_s())
    return Response(b"", content_type="application/json")


@bp.post("/models/<model_name:name>/unload")
def unload(name: str) -> Response:
    get(current_app).unload(name, _rest_parameters("unload"), timeout_s=get_layer(current_app).deadline_s())
    return Response(b"", content_type="application/json")


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)


# -- gRPC ---------------------------------------------------------------------------------


def restriction(repository: Repository) -> Callable[[str, Any], None]:
    """RESTRICTED_MODEL_CONTROL on gRPC: check(method, metadata) raises Forbidden for a restricted
    method called without the key; app/grpc_calls.py answers it PERMISSION_DENIED before its
    handler runs."""
    def check(method: str, metadata: Any) -> None:
        if method not in RESTRICTED_METHODS or not repository.key:
            return
        # Every value of the key, as gRPC hands a repeated key over: one entry each.
        sent = [value if isinstance(value, str) else "" for key, value in metadata or () if key == repository.key]
        repository.check(method, sent, where="metadata key")

    return check


def serve_grpc(servicer: Any, repository: Repository, observed: Callable[[str, Callable], Callable]) -> None:
    """Give v2's gRPC servicer the repository's three methods (before it is added to a server)."""
    def index(request: Any, _record: Any, context: grpc.ServicerContext) -> Any:
        _one_repository(request)
        return service_pb2.RepositoryIndexResponse(models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(**model) for model in repository.index(ready=request.ready)])

    def load(request: Any, _record: Any, context: grpc.ServicerContext) -> Any:
        _one_repository(request)
        repository.load(request.model_name, _grpc_parameters(request, "load"), timeout_s=context.time_remaining())
        return service_pb2.RepositoryModelLoadResponse()

    def unload(request: Any, _record: Any, context: grpc.ServicerContext) -> Any:
        _one_repository(request)
        repository.unload(request.model_name, _grpc_parameters(request, "unload"),
                          timeout_s=context.time_remaining())
        return service_pb2.RepositoryModelUnloadResponse()

    servicer.RepositoryIndex = observed(f"{_SERVICE}/RepositoryIndex", index)
    servicer.RepositoryModelLoad = observed(f"{_SERVICE}/RepositoryModelLoad", load)
    servicer.RepositoryModelUnload = observed(f"{_SERVICE}/RepositoryModelUnload", unload)


def _one_repository(request: Any) -> None:
    if request.repository_name:
        raise BadRequest("'repository_name' specification is not supported")


def _grpc_parameters(request: Any, call: str) -> dict[str, Any]:
    parameters = {}
    for name, parameter in request.parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        expected = _expected(call, name)
        if expected is not None and choice != expected[1]:
            # Triton's words (grpc_server.cc, RepositoryModelLoad and RepositoryModelUnload).
            raise BadRequest(f"invalid value type for load parameter '{name}', expected {expected[1]}."
                             if call == "load" else
                             f"invalid value type for '{name}' parameter, expected {expected[1]}.")
        parameters[name] = getattr(parameter, choice) if choice else None
    return parameters
