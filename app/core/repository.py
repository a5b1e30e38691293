"""Triton's model repository extension: what MODEL_REPOSITORY holds, and loading and unloading it.

The index lists every model of MODEL_REPOSITORY and every model served, with each version's state
(READY, LOADING, UNLOADING, UNAVAILABLE and its reason). Load and unload change the server's model
config as TF Serving's HandleReloadConfigRequest does, by the same path (ModelRegistry.edit_config;
with MODEL_PROCESSES, the model processes apply it): every model process and worker has applied it
before the call answers, within the call's deadline (REST: REQUEST_TIMEOUT_MS; gRPC: the client's,
as HandleReloadConfigRequest). A model that fails to load is answered with its reason, and listed
UNAVAILABLE with it, while the others go on. They are refused (503, UNAVAILABLE, Triton's words)
unless MODEL_CONTROL_MODE is explicit. Each parameter Triton reads is type-checked, in Triton's
words on each door (`expected_parameter`); then every load parameter, and any other unload one, is
refused. Its doors: app/http/v2_repository.py and app/grpc/v2.py.

A model folder may hold a handler, `handler.py` (app/core/handlers.py): a load imports it only
with MODEL_REPOSITORY_HANDLERS=true, and refuses the folder otherwise, naming the setting.

Who may call them (RESTRICTED_MODEL_CONTROL, Triton's `model-repository` category) is the
doors' check, before they call here (app/wire/restricted.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from app.core.errors import BadRequest, NotFound, Unavailable
from app.core.registry import AVAILABLE, END, LOADING, UNLOADING, ConfigEdit, ModelRegistry
from app.ops.settings import MODEL_NAME_PATTERN, Settings

# TF Serving's version states as Triton's index names them.
_STATES = {AVAILABLE: "READY", LOADING: "LOADING", UNLOADING: "UNLOADING", END: "UNAVAILABLE"}


class Repository:
    """MODEL_REPOSITORY and the registry it changes, for both front doors."""

    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self.folder = Path(settings.model_repository) if settings.model_repository else None
        self.explicit = settings.model_control_mode == "explicit"
        # Whether a load imports the handler.py a model's folder holds (app/core/handlers.py).
        self.handlers = settings.model_repository_handlers
        self._registry = registry

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
        if not self.handlers and (path / "handler.py").is_file():
            # A handler is code: the repository's folders are data unless the operator says otherwise.
            raise BadRequest(f"failed to load '{name}': its folder holds handler.py, which is code; set "
                             "MODEL_REPOSITORY_HANDLERS=true to import it")
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
PARAMETERS: dict[str, dict[str, tuple[type, str]]] = {
    "load": {"config": (str, "string_param"), "file:": (str, "bytes_param")},
    "unload": {"unload_dependents": (bool, "bool_param")},
}


def expected_parameter(call: str, name: str) -> tuple[type, str] | None:
    """The type a repository call's parameter must have: (REST's JSON type, gRPC's field), or None."""
    known = PARAMETERS[call]
    return known.get(name) or next((kind for prefix, kind in known.items()
                                    if prefix.endswith(":") and name.startswith(prefix)), None)
