"""Triton's model repository extension: what MODEL_REPOSITORY holds, and loading and unloading it.

The index lists every model of MODEL_REPOSITORY and every model served, with each version's state
(READY, LOADING, UNLOADING, UNAVAILABLE and its reason). Load and unload change the server's model
config as TF Serving's HandleReloadConfigRequest does (LiveConfig.edit in app/core/registry.py):
every worker has applied it before the call answers, and a model that fails to load is answered
with its reason while the others go on. They are refused (503, UNAVAILABLE, Triton's words)
unless MODEL_CONTROL_MODE is explicit. Its doors: app/http/v2_repository.py and app/grpc/v2.py.

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

from app.core.errors import BadRequest, Forbidden, NotFound, Unavailable
from app.core.registry import AVAILABLE, END, LOADING, UNLOADING, ModelRegistry
from app.ops.settings import MODEL_NAME_PATTERN, ModelConfig, Settings

log = logging.getLogger(__name__)

# TF Serving's version states as Triton's index names them.
_STATES = {AVAILABLE: "READY", LOADING: "LOADING", UNLOADING: "UNLOADING", END: "UNAVAILABLE"}


class Repository:
    """MODEL_REPOSITORY and the registry it changes, for both front doors."""

    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self.folder = Path(settings.model_repository) if settings.model_repository else None
        self.explicit = settings.model_control_mode == "explicit"
        key, _, value = settings.restricted_model_control.partition("=")
        self.key, self._value = key, value.encode()
        self._registry = registry

    def check(self, call: str, sent: str | None, *, where: str) -> None:
        """Refuse `call` unless it came with the restriction's key and value (`sent`: what it had)."""
        if not self.key or (sent is not None and hmac.compare_digest(sent.encode(), self._value)):
            return
        log.warning("refused %s: no valid '%s' %s", call, self.key, where)
        raise Forbidden(f"This API is restricted, expecting {where} '{self.key}'")

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

        def loaded(configs: list[ModelConfig]) -> dict[str, Any]:
            entries = [config_entry(config) for config in configs if config.name != name]
            return {"models": [*entries, {"name": name, "path": str(path)}],
                    "default": entries[0]["name"] if entries else name}

        try:
            self._edit(loaded, timeout_s)
        except BadRequest as exc:
            raise BadRequest(f"failed to load '{name}': {exc.message}") from None

    def unload(self, name: str, parameters: dict[str, Any], *, timeout_s: float | None) -> None:
        # No model depends on another here: unload_dependents has nothing more to unload.
        self._control(parameters, allowed=("unload_dependents",))
        if not self._registry.versions(name):
            return  # as Triton: unloading what is not served succeeds

        def unloaded(configs: list[ModelConfig]) -> dict[str, Any]:
            entries = [config_entry(config) for config in configs if config.name != name]
            if not entries:
                raise BadRequest(f"failed to unload '{name}': it is the only model served, and the server "
                                 "serves at least one")
            return {"models": entries}

        self._edit(unloaded, timeout_s)

    def _control(self, parameters: dict[str, Any], *, allowed: tuple[str, ...]) -> None:
        if not self.explicit:
            # Triton's words and status when its model control mode is not explicit.
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled")
        unknown = sorted(set(parameters) - set(allowed))
        if unknown:
            raise BadRequest(f"parameter(s) {unknown} not supported: a model is loaded from its folder in "
                             "MODEL_REPOSITORY as it is")

    def _edit(self, change: Callable[[list[ModelConfig]], dict[str, Any]], timeout_s: float | None) -> None:
        live = self._registry.live_config
        if live is None:
            raise Unavailable("this server's models come from no config it can change")
        live.edit(change, timeout_s=timeout_s)


def config_entry(config: ModelConfig) -> dict[str, Any]:
    """A served model's config as a MODEL_CONFIG entry that reads back equal: unchanged by a reload."""
    kind, value = config.version_policy
    policy: dict[str, Any] = {}  # "all"
    if kind == "latest":
        policy = {"num_versions": value}
    elif kind == "specific":
        policy = {"versions": list(value)}  # type: ignore[arg-type]
    entry: dict[str, Any] = {
        "name": config.name, "max_batch_size": config.max_batch_size, "batch_timeout_ms": config.batch_timeout_ms,
        "max_queue_rows": config.max_queue_rows, "max_request_rows": config.max_request_rows,
        "pad_variable_length": config.pad_variable_length, "pad_value": config.pad_value,
        "length_buckets": list(config.length_buckets), "model_version_policy": {kind: policy},
        "version_labels": dict(config.version_labels)}
    if config.path is not None:
        entry["path"] = config.path
    return entry


# -- REST ---------------------------------------------------------------------------------


# -- gRPC ---------------------------------------------------------------------------------


