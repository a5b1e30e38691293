"""The models a worker serves: their versions, labels and signatures, each with its own batcher.

A model whose path is a TensorFlow Serving base folder (numbered sub-folders) serves the
versions its `model_version_policy` names (TF Serving's: the `latest` N, `all`, or a
`specific` list), and is polled: a version the policy newly wants is loaded and warmed
beside the others, then served; one it no longer wants is retired: taken out of `get()`
at once, then closed, with drain, once every request that reached it has its answer. A
version's state follows TF Serving's ManagerState: LOADING, AVAILABLE, UNLOADING, END.

Every (version, signature) pair has its own batcher, so requests of different versions
or signatures never share a predict call.

A request pinned to a version or a label is served by that version or refused with TF
Serving's error, never by another. An unpinned request that picked a version just
before it was retired is sent on to the newest version instead; retirement waits for
requests already inside the old version, so no request fails, or counts as a rejection,
because of a version change.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from app.core import handlers, models, padding, shared_config
from app.core.batching import Batcher, BatchObserver, BatchResult, Engine, Tensors, bucket_sizes
from app.core.call import Call
from app.core.errors import BadRequest, NotFound, SignatureNotFound, Unavailable
from app.ops import queue_policy, runtime
from app.ops.metrics import Metrics
from app.ops.settings import RELOAD, ModelConfig, Settings, SettingsError, configs_from_document, model_configs

log = logging.getLogger(__name__)

# TF Serving's ManagerState names (core/servable_state.h), as GetModelStatus reports them.
LOADING, AVAILABLE, UNLOADING, END = "LOADING", "AVAILABLE", "UNLOADING", "END"


def servable_not_found(name: str, version: int | None) -> str:
    """TF Serving's message (core/basic_manager.cc), ServableRequest::DebugString included."""
    request = f"Latest({name})" if version is None else f"Specific({name}, {version})"
    return f"Servable not found for request: {request}"


@dataclasses.dataclass(eq=False)
class Servable:
    """One loaded version of a model: its signatures, each with its own batcher."""

    model: models.LoadedModel
    batchers: dict[str, Engine]
    # The model's handler (app/core/handlers.py): `model` is then the model as clients see it, and
    # its batchers run the model's own signatures behind the handler's.
    handler: handlers.Handled | None = None

    def __post_init__(self) -> None:
        self._users = threading.Condition()
        self._inside = 0
        self.retiring = threading.Event()  # set once no new request may enter

    @property
    def batcher(self) -> Engine:
        """The batcher of the model's main signature (serving_default where it has one)."""
        return self.batchers[self.model.default_signature]

    def signature(self, name: str | None = None) -> models.Signature:
        key = name or models.DEFAULT_SIGNATURE
        signature = self.model.signatures.get(key)
        if signature is None:
            # TF Serving's words (model_servers/http_rest_api_handler.cc, GetInfoMap).
            raise SignatureNotFound(f'Serving signature name: "{key}" not found in signature def (unknown '
                                    f"signature_name; model '{self.model.name}' v{self.model.version} has "
                                    f"{sorted(self.model.signatures)})", key=key)
        return signature

    def status(self) -> dict[str, Any]:
        batchers = list(self.batchers.values())
        main = self.batcher.info
        return {
            "version": self.model.version,
            "source": self.model.source,
            "alive": all(batcher.alive for batcher in batchers),
            "queued_rows": sum(batcher.queued_rows for batcher in batchers),
            "batches_run": sum(batcher.batches_run for batcher in batchers),
            "max_batch_size": main.max_batch_size,
            "batch_timeout_ms": main.batch_timeout_s * 1000,
            "fill_under_load": main.fill_under_load,
            "signatures": sorted(self.batchers),
            "padded_signatures": sorted(key for key, batcher in self.batchers.items() if batcher.info.padded),
            # Served one request per call, as sent: no batch dimension to stack requests on.
            "unbatched_signatures": sorted(key for key, batcher in self.batchers.items() if batcher.info.whole),
            "load_seconds": round(self.model.load_s, 3),
            "warmup_seconds": round(self.model.warmup_s, 3),
        }

    # A retired servable takes no new request; retire() waits for those already inside.

    def enter(self) -> bool:
        with self._users:
            if self.retiring.is_set():
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._users:
            self._inside -= 1
            if self._inside == 0:
                self._users.notify_all()

    def retire(self) -> None:
        with self._users:
            self.retiring.set()
            self._users.wait_for(lambda: self._inside == 0)
        self.close(drain=True)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        for batcher in self.batchers.values():
            batcher.close(drain=drain, timeout_s=timeout_s)


# What loading a version does besides building its batchers, given by whoever starts the
# registry (app/core/loading.py), so that loading a model imports no front door and no tracing.
WarmUp = Callable[["Servable", Settings, Metrics], int]
ObserverFactory = Callable[[Metrics, Settings, models.LoadedModel, str], BatchObserver]


def metrics_observer(metrics: Metrics, _settings: Settings, model: models.LoadedModel, _signature: str
                     ) -> BatchObserver:
    """A batcher's observer: the batch metrics of its model."""
    return metrics.observer(model.name)


@dataclasses.dataclass(frozen=True)
class Loading:
    """The steps a load takes from above: warm-up replay (with ENABLE_MODEL_WARMUP) and each
    batcher's observer (the metrics', or a tracer around them)."""

    warm_up: WarmUp | None = None
    observer: ObserverFactory = metrics_observer


def load_servable(config: ModelConfig, settings: Settings, metrics: Metrics, version: int | None = None, *,
                  on_broken: Callable[[Batcher], None] | None = None, loading: Loading = Loading()) -> Servable:
    handler = handlers.load(config.handler) if config.handler else None
    model = models.load_model(config.path, name=config.name, method=settings.predict_method, version=version,
                              custom_objects=handlers.custom_objects(handler))
    buckets = bucket_sizes(config.max_batch_size)
    models.warm_up(model, buckets, padding.warm_lengths(config))
    paddings = padding.model_paddings(model, config)
    metrics.load_seconds.labels(config.name).set(model.load_s)
    metrics.warmup_seconds.labels(config.name).set(model.warmup_s)
    # Clients see the handler's signature; its batcher runs the model's own behind it.
    shown, handled = handlers.view(model, handler) if handler is not None else (model, None)
    runs = handled.model_signatures if handled is not None and handled.model_signatures else model.signatures
    batchers: dict[str, Engine] = {}
    for key, signature in runs.items():
        batchers[key] = Batcher(
            signature.predict,
            name=config.name if len(runs) == 1 else f"{config.name}/{key}",
            max_batch_size=config.max_batch_size,
            batch_timeout_ms=config.batch_timeout_ms,
            max_queue_rows=config.max_queue_rows,
            max_request_rows=config.max_request_rows,
            batching=settings.batching,
            whole=not signature.batchable,
            fill_under_load=settings.batch_fill_under_load,
            buckets=buckets,
            padding=paddings[signature.name],
            priorities=config.priorities,
            observer=loading.observer(metrics, settings, model, key),
            on_broken=on_broken,
        )
    log.info("model '%s' v%d from %s loaded in %.2f s (signatures: %s)%s", config.name, model.version, model.source,
             model.load_s, ", ".join(sorted(model.signatures)), f", handler {config.handler}" if handler else "")
    servable = Servable(shown, batchers, handled)
    if settings.enable_model_warmup and loading.warm_up is not None:
        try:
            loading.warm_up(servable, settings, metrics)
        except BaseException:
            servable.close(drain=False)
            raise
    return servable


def without_paths(message: str, *, name: str, path: str) -> str:
    """A load error as clients see it (GetModelStatus): the model's folder named, not its path on
    the host. The log keeps the whole message; READYZ_DETAIL=true shows it to clients too."""
    spellings = {path, os.path.abspath(path), os.path.realpath(path)} if path else set()
    for spelling in sorted(spellings, key=len, reverse=True):
        message = message.replace(spelling, f"<model {name}>")
    return message


def wanted_versions(config: ModelConfig, available: list[int]) -> list[int]:
    """The versions TF Serving's model_version_policy serves out of those on disk."""
    kind, argument = config.version_policy
    if kind == "all":
        return sorted(available)
    if isinstance(argument, tuple):  # "specific"
        return sorted(set(available) & set(argument))
    return sorted(available)[-argument:]


@dataclasses.dataclass
class _VersionState:
    state: str
    error_message: str = ""

    def as_json(self, version: int) -> dict[str, Any]:
        return {
            "version": str(version),
            "state": self.state,
            "status": {"error_code": "UNKNOWN" if self.error_message else "OK", "error_message": self.error_message},
        }


class _Model:
    def __init__(self, name: str, labels: dict[str, int]) -> None:
        self.name = name
        self.labels = labels
        self.serving: dict[int, Servable] = {}
        self.states: dict[int, _VersionState] = {}
        # What each retired version's signatures took, by name: a request resolved to it before
        # it was retired is sent on only to a version whose signature takes the same.
        self.retired_inputs: dict[int, dict[str, tuple[models.TensorInfo, ...]]] = {}


class ModelRegistry:
    """The versions a worker serves and their labels and states: what a request is resolved
    to. What is served is kept in line with the model config by `LiveConfig` below."""

    def __init__(self, default_name: str) -> None:
        self.default_name = default_name
        self._models: dict[str, _Model] = {}
        self._lock = threading.Lock()
        self.live_config: LiveConfig | None = None
        self.poller: VersionPoller | None = None
        self.config_poller: ConfigPoller | None = None

    def add(self, servable: Servable) -> None:
        """Serve `servable` beside the versions of its model already served."""
        name, version = servable.model.name, servable.model.version
        with self._lock:
            entry = self._models.setdefault(name, _Model(name, {}))
            entry.serving[version] = servable
            entry.states[version] = _VersionState(AVAILABLE)

    def set_labels(self, name: str, labels: dict[str, int]) -> None:
        with self._lock:
            self._models.setdefault(name, _Model(name, {})).labels = dict(labels)

    def get(self, name: str | None = None, version: int | None = None, *, label: str | None = None) -> Servable:
        """The servable of a version, of a label's version, or of the newest version served."""
        name = name or self.default_name
        with self._lock:
            entry = self._models.get(name)
            if entry is None or not entry.serving:  # never served, or removed from the config
                # The names of the other models served are not the client's to learn.
                raise NotFound(f"{servable_not_found(name, version)}: no model named {name!r}")
            if label is not None:
                if label not in entry.labels:
                    # TF Serving answers INVALID_ARGUMENT, 400 (model_servers/server_core.cc).
                    raise BadRequest(f"Unrecognized servable version label: {label}")
                version = entry.labels[label]
            if version is None and entry.serving:
                return entry.serving[max(entry.serving)]
            servable = entry.serving.get(version) if version is not None else None
            if servable is None:
                raise NotFound(f"{servable_not_found(name, version)}: model {name!r} has no version {version}; "
                               f"it serves {sorted(entry.serving)}")
            return servable

    def submit(self, call: Call, servable: Servable, signature: models.Signature,
               inputs: Tensors) -> tuple[Servable, Engine, concurrent.futures.Future[BatchResult]]:
        """Queue the call's rows on `signature`'s batcher of the servable (or of the version `enter`
        sends them to); the version, its batcher and the answer's future. The version is left once
        the rows are answered, not when their caller stops waiting: rows still queued keep it serving."""
        servable = self.enter(call, servable.model.name, servable.model.version, signature.name, servable=servable)
        engine = servable.batchers[signature.name]
        try:
            future = engine.submit(call, inputs)
        except BaseException:
            servable.leave()
            raise
        future.add_done_callback(lambda _future: servable.leave())
        return servable, engine, future

    def enter(self, call: Call, name: str, version: int, signature: str, *,
              servable: Servable | None = None) -> Servable:
        """Enter the version a call was resolved to (`servable`, where the caller holds it). If it
        was retired since: refuse a pinned call (a version or a label) as TF Serving refuses a
        version it does not serve, and send an unpinned one to the newest version, if its
        signature of that name takes the inputs the resolved one took. The registry's requests
        and a model process's (whose worker resolved them) take this one path."""
        resolved = servable = servable if servable is not None else self._serving(name, version)
        while servable is None or not servable.enter():
            if call.model.pinned:
                raise NotFound(f"{servable_not_found(name, version)}: version {version} of model {name!r} "
                               "was unloaded before this request reached it")
            if resolved is not None:
                took = _inputs(resolved, signature)
            else:  # gone from the registry already: what it took is kept
                took = self._retired_inputs(name, version, signature)
            servable = self.get(name)
            if took is None or tuple(servable.signature(signature).inputs) != took:
                raise Unavailable(f"model {name!r} changed to v{servable.model.version}, whose signature "
                                  f"'{signature}' takes other inputs, while this request waited; retry")
        return servable

    def _serving(self, name: str, version: int) -> Servable | None:
        with self._lock:
            entry = self._models.get(name)
            return entry.serving.get(version) if entry is not None else None

    def _retired_inputs(self, name: str, version: int, signature: str) -> tuple[models.TensorInfo, ...] | None:
        """The inputs `signature` of a retired version took (kept once it is no longer served)."""
        with self._lock:
            entry = self._models.get(name)
            took = entry.retired_inputs.get(version, {}) if entry is not None else {}
            return took.get(signature)

    def retire(self, name: str, version: int) -> None:
        """Stop serving a version: no new request reaches it; those inside finish first."""
        with self._lock:
            entry = self._models[name]
            servable = entry.serving.pop(version)
            entry.states[version] = _VersionState(UNLOADING)
            entry.retired_inputs[version] = {key: tuple(signature.inputs)
                                             for key, signature in servable.model.signatures.items()}
        servable.retire()
        with self._lock:
            entry.states[version] = _VersionState(END)
        del servable  # the last reference here: what refreeze_heap collects
        runtime.refreeze_heap()
        log.info("model '%s' v%d unloaded; serving %s", name, version, sorted(entry.serving))

    def versions(self, name: str) -> list[int]:
        with self._lock:
            entry = self._models.get(name)
            return sorted(entry.serving) if entry is not None else []

    def set_state(self, name: str, version: int, state: str, error_message: str = "") -> None:
        with self._lock:
            self._models.setdefault(name, _Model(name, {})).states[version] = _VersionState(state, error_message)

    def model_status(self, name: str, version: int | None = None, *, label: str | None = None) -> list[dict[str, Any]]:
        """GetModelStatus's model_version_status (model_servers/get_model_status_impl.cc): every
        version the server knows of, newest first, or the one asked for."""
        with self._lock:
            entry = self._models.get(name)
            if entry is None or not entry.states:
                raise NotFound(f"Could not find any versions of model {name}")
            if label is not None:
                if label not in entry.labels:
                    raise BadRequest(f"Unrecognized servable version label: {label}")
                version = entry.labels[label]
            if version is not None:
                if version not in entry.states:
                    raise NotFound(f"Could not find version {version} of model {name}")
                return [entry.states[version].as_json(version)]
            return [entry.states[v].as_json(v) for v in sorted(entry.states, reverse=True)]

    def config_entry(self, name: str) -> dict[str, Any] | None:
        """The MODEL_CONFIG entry a served model came from (`config_entry`); None where none is known."""
        live = self.live_config
        config = live.configs.get(name) if live is not None else None
        return config_entry(config) if config is not None else None

    def items(self) -> list[tuple[str, Servable]]:
        """Each model with its newest served version."""
        with self._lock:
            return sorted((name, entry.serving[max(entry.serving)]) for name, entry in self._models.items()
                          if entry.serving)

    def servables(self) -> list[Servable]:
        with self._lock:
            return [servable for entry in self._models.values() for servable in entry.serving.values()]

    def flush(self, *, later_too: bool = False) -> None:
        """Every batch forming now, in every version and signature, goes without waiting out its
        window; with `later_too`, every later one as well (Batcher.flush)."""
        for servable in self.servables():
            for batcher in servable.batchers.values():
                batcher.flush(later_too=later_too)

    @property
    def ready(self) -> bool:
        servables = self.servables()
        return bool(servables) and all(batcher.alive for s in servables for batcher in s.batchers.values())

    def names(self) -> list[str]:
        """Every model served or known by a state (unloaded, failed to load)."""
        with self._lock:
            return sorted(name for name, entry in self._models.items() if entry.serving or entry.states)

    def reload_config(self, document: dict[str, Any], *, timeout_s: float | None) -> None:
        """HandleReloadConfigRequest: serve the models of a MODEL_CONFIG document, in every worker."""
        if self.live_config is None:
            raise Unavailable("this server's models come from no config it can reload")
        self.live_config.reload(document, RELOAD, timeout_s=timeout_s)

    def edit_config(self, edit: ConfigEdit, *, timeout_s: float | None) -> None:
        """v2's repository load or unload: the served config changed by `edit`, in every worker."""
        if self.live_config is None:
            raise Unavailable("this server's models come from no config it can change")
        self.live_config.edit(edit, timeout_s=timeout_s)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        if self.live_config is not None and self.live_config.shared is not None:
            self.live_config.shared.close()  # a stopping worker takes no more reloads
        for poller in (self.config_poller, self.poller):
            if poller is not None:
                poller.stop()
        for servable in self.servables():
            servable.close(drain=drain, timeout_s=timeout_s)


class LiveConfig:
    """Keeps what a registry serves in line with the model config: models served, added,
    changed and removed (a ReloadConfigRequest, or MODEL_CONFIG polled), and each model's
    versions loaded and retired as its folder and version policy say (the version poller).

    Under Gunicorn a reload is the server's, not this worker's: `shared` publishes it to the
    sibling workers and applies theirs here (app/core/shared_config.py), each generation once."""

    def __init__(self, registry: ModelRegistry, settings: Settings, metrics: Metrics, *,
                 on_broken: Callable[[Batcher], None] | None = None, loading: Loading = Loading()) -> None:
        self.registry = registry
        self._loading = loading
        self._settings = settings
        self._metrics = metrics
        # What a batcher whose thread died calls: the process asks to be replaced.
        self._on_broken = on_broken
        # The config each served model came from; changed only under _changing, which also
        # keeps a version poll and a config reload from loading the same version twice.
        self.configs: dict[str, ModelConfig] = {}
        self._changing = threading.RLock()
        self._failed: set[tuple[str, int]] = set()
        # The models last asked for (by start-up, a reload or the polled file), loaded or not.
        self.requested: list[ModelConfig] = []
        self.shared: shared_config.SharedConfig | None = None
        # The newest reload generation applied here, and what failed in it.
        self.generation = 0
        self._generation_error = ""
        # Called once a reload is applied here, before it answers (a model process tells its workers).
        self.on_applied: Callable[[], None] | None = None

    def serve(self, config: ModelConfig) -> None:
        """Load and serve a model the registry does not serve yet, with its labels."""
        available = models.available_versions(config.path) if config.path else []
        # A path without numbered versions is served as version 1 (models.resolve_version).
        wanted = wanted_versions(config, available) if available else [1]
        with self._changing:
            try:
                if not wanted:
                    raise models.ModelLoadError(f"model '{config.name}': its model_version_policy "
                                                f"{config.version_policy} wants none of the versions in "
                                                f"{config.path!r}: {available}")
                for version in wanted:
                    self.registry.add(load_servable(config, self._settings, self._metrics,
                                                    version if available else None, on_broken=self._on_broken,
                                                    loading=self._loading))
                self.label(config)
            except Exception as exc:
                # Served in full or not at all: a live reload must not leave versions no config names.
                for version in self.registry.versions(config.name):
                    self.registry.retire(config.name, version)
                # Each version asked for ends with the reason: Triton's index lists it UNAVAILABLE
                # with it, TF Serving's GetModelStatus END with it.
                message = self.load_error(config, exc)
                for version in wanted or available[-1:]:
                    self.registry.set_state(config.name, version, END, message)
                raise
            self.configs[config.name] = config

    def load_error(self, config: ModelConfig, exc: Exception) -> str:
        """Why a load failed, as a version's status tells clients (paths hidden but with READYZ_DETAIL)."""
        message = f"{type(exc).__name__}: {exc}"
        if not self._settings.readyz_detail:
            message = without_paths(message, name=config.name, path=config.path or "")
        return message[:1000]

    def label(self, config: ModelConfig) -> None:
        labels = dict(config.version_labels)
        served = self.registry.versions(config.name)
        for label, version in labels.items():
            # As TF Serving (server_core.cc): a label may only name a version being served.
            if version not in served:
                raise models.ModelLoadError(f"model '{config.name}': version_labels: {label!r} names version "
                                            f"{version}, which is not served (served: {served})")
        self.registry.set_labels(config.name, labels)

    def apply(self, configs: list[ModelConfig]) -> None:
        """Serve exactly these models, live, as TF Serving's ReloadConfig: new ones are loaded,
        those left out unloaded (with drain), and changed ones get the versions and labels
        their new policy names. A model whose load fails is not served; the others change."""
        with self._changing:
            self.requested = list(configs)
            wanted = {config.name: config for config in configs}
            failures = []
            for name in [name for name in self.configs if name not in wanted]:
                for version in self.registry.versions(name):
                    self.registry.retire(name, version)
                del self.configs[name]
            for config in configs:
                try:
                    current = self.configs.get(config.name)
                    if current is None:
                        self.serve(config)
                    elif current != config:
                        self._change(current, config)
                except Exception as exc:
                    log.exception("model '%s': its new config cannot be applied", config.name)
                    failures.append(f"model '{config.name}': {type(exc).__name__}: {exc}")
            self.registry.default_name = configs[0].name
            if failures:
                raise models.ModelLoadError("; ".join(failures))

    def reload(self, document: dict[str, Any], where: str, *, timeout_s: float | None = None) -> None:
        """Apply a MODEL_CONFIG document (from a ReloadConfigRequest) here and, under Gunicorn, in
        every sibling worker, within `timeout_s`; BadRequest names what is wrong."""
        try:
            configs = configs_from_document(document, self._settings, where)
        except SettingsError as exc:
            raise BadRequest(str(exc)) from None
        if self.shared is not None:
            self.shared.publish(document, self.apply_generation, timeout_s=timeout_s)
            return
        try:
            self.apply(configs)
        except models.ModelLoadError as exc:
            raise BadRequest(str(exc)) from None
        finally:
            self._applied()

    def edit(self, change: Callable[[list[ModelConfig]], dict[str, Any]], *, timeout_s: float | None) -> None:
        """A reload of the models served here, changed by `change` (v2's repository load and unload).
        Under Gunicorn it is made under the reload lock, once the newest reload is applied here:
        two edits in two workers at once both take effect."""
        def document(latest: shared_config.Generation | None) -> dict[str, Any]:
            if latest is not None:
                self.apply_generation(latest)
            with self._changing:
                edited = change(sorted(self.configs.values(), key=lambda c: c.name != self.registry.default_name))
            try:
                configs_from_document(edited, self._settings, RELOAD)
            except SettingsError as exc:
                raise BadRequest(str(exc)) from None
            return edited

        if self.shared is None:
            with self._changing:
                self.reload(document(None), RELOAD, timeout_s=timeout_s)
        else:
            self.shared.publish(document, self.apply_generation, timeout_s=timeout_s)

    def apply_generation(self, generation: shared_config.Generation) -> tuple[int, str]:
        """Apply a reload published by this worker or a sibling, unless a newer one was: the
        number of the newest applied, and what failed in it ("" if nothing)."""
        with self._changing:
            if generation.number > self.generation:
                self.generation, self._generation_error = generation.number, ""
                try:
                    self.apply(configs_from_document(generation.document, self._settings, RELOAD))
                except (SettingsError, models.ModelLoadError) as exc:
                    self._generation_error = str(exc)
            applied = self.generation, self._generation_error
        self._applied()
        return applied

    def _applied(self) -> None:
        if self.on_applied is not None:
            self.on_applied()

    def _change(self, current: ModelConfig, config: ModelConfig) -> None:
        if not (config.path and models.available_versions(config.path)) or config.path != current.path \
                or config.handler != current.handler:
            raise models.ModelLoadError("only the version policy, labels and batching of a model served from a base "
                                        "folder of numbered versions change live; remove the model and add it "
                                        "under another name to change its path or its handler")
        self.configs[config.name] = config
        self._failed = {key for key in self._failed if key[0] != config.name}
        self.sync_versions(config)
        self.label(config)

    def versioned_configs(self) -> list[ModelConfig]:
        with self._changing:
            return [config for config in self.configs.values()
                    if config.path and models.available_versions(config.path)]

    def sync_versions(self, config: ModelConfig, *, stopped: Callable[[], bool] = lambda: False) -> None:
        """Load the versions the policy newly wants; retire those it no longer wants. `stopped`
        ends it early (the server is stopping), between loads and dropping one just made."""
        with self._changing:
            if self.configs.get(config.name) is not config or not config.path:
                return  # removed or replaced while the poll had it, or no folder to poll
            wanted = wanted_versions(config, models.available_versions(config.path))
            if not wanted:
                return  # an emptied folder is more likely a mistake than a wish to serve nothing
            served = self.registry.versions(config.name)
            for version in wanted:
                if stopped():
                    return
                if version in served or (config.name, version) in self._failed:
                    continue
                self.registry.set_state(config.name, version, LOADING)
                try:
                    servable = load_servable(config, self._settings, self._metrics, version, on_broken=self._on_broken,
                                             loading=self._loading)
                except Exception as exc:
                    self._failed.add((config.name, version))
                    self.registry.set_state(config.name, version, END, self.load_error(config, exc))
                    log.exception("cannot load version %d of model '%s'; serving %s", version, config.name, served)
                    continue
                if stopped():
                    servable.close(drain=False)
                    return
                self.registry.add(servable)
            # Retire only what the policy dropped, and never the last version served: as TF
            # Serving's availability-preserving policy, a failed load keeps the old one.
            served = self.registry.versions(config.name)
            keep = [version for version in served if version in wanted]
            if keep:
                for version in served:
                    if version not in keep:
                        self.registry.retire(config.name, version)


def _inputs(servable: Servable, signature: str) -> tuple[models.TensorInfo, ...] | None:
    found = servable.model.signatures.get(signature)
    return tuple(found.inputs) if found is not None else None




@dataclasses.dataclass(frozen=True)
class ConfigEdit:
    """v2's repository load (`path` given: serve model `name` from it) or unload (stop serving
    `name`), as data a worker can hand a model process; called, it is LiveConfig.edit's change."""

    name: str
    path: str | None = None

    def __call__(self, configs: list[ModelConfig]) -> dict[str, Any]:
        """The MODEL_CONFIG document of the served `configs` (the default first) so changed."""
        entries = [config_entry(config) for config in configs if config.name != self.name]
        if self.path is not None:
            return {"models": [*entries, {"name": self.name, "path": self.path}],
                    "default": entries[0]["name"] if entries else self.name}
        if not entries:
            raise BadRequest(f"failed to unload '{self.name}': it is the only model served, and the server "
                             "serves at least one")
        return {"models": entries}


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
    if config.payload_log_sampling_rate:
        entry["payload_log_sampling_rate"] = config.payload_log_sampling_rate
    if config.priorities != queue_policy.ONE_LEVEL:
        priorities = config.priorities
        entry.update(priority_levels=priorities.levels, default_priority_level=priorities.default_level,
                     priority_queue_policy={str(level): {
                         "max_queue_size": queue.max_queue_rows,
                         "default_timeout_microseconds": round(queue.default_timeout_s * 1e6)}
                         for level, queue in enumerate(priorities.policies, start=1)})
    return entry


class _Poller:
    """A daemon thread that calls `tick` every `interval_s` until stopped."""

    name = "poller"

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.tick()

    def tick(self) -> None:
        raise NotImplementedError


class VersionPoller(_Poller):
    """Checks versioned base folders and serves what each model's version policy wants."""

    name = "version-poller"

    def __init__(self, live_config: LiveConfig, interval_s: float) -> None:
        self._live_config = live_config
        super().__init__(interval_s)

    def tick(self) -> None:
        for config in self._live_config.versioned_configs():
            if self._stopped.is_set():
                return
            try:
                self._live_config.sync_versions(config, stopped=self._stopped.is_set)
            except Exception:
                log.exception("version check of model '%s' failed", config.name)


class ConfigPoller(_Poller):
    """Reads MODEL_CONFIG again and applies it unless it is what was last asked for (TF
    Serving's --model_config_file_poll_wait_seconds). As TF Serving, which applies the file at
    every poll, the file wins over a reload at the next poll. A file that cannot be read keeps
    what is served."""

    name = "config-poller"

    def __init__(self, live_config: LiveConfig, settings: Settings, interval_s: float) -> None:
        self._live_config = live_config
        self._settings = settings
        super().__init__(interval_s)

    def tick(self) -> None:
        try:
            configs = model_configs(self._settings)
        except SettingsError as exc:
            log.error("MODEL_CONFIG not applied: %s", exc)
            return
        if configs == self._live_config.requested:
            return
        try:
            self._live_config.apply(configs)
        except Exception:
            log.exception("MODEL_CONFIG applied in part")
        else:
            log.info("MODEL_CONFIG applied: serving %s", [config.name for config in configs])


def start(settings: Settings, metrics: Metrics, *, loading: Loading = Loading(),
          on_broken: Callable[[Batcher], None] | None = None) -> ModelRegistry:
    """The registry of this process, its models loaded, kept in line with the model config."""
    # Joined before the config is read: a reload published from now on reaches this worker.
    shared = shared_config.join()
    polled_config = settings.model_config is not None and settings.model_config_poll_seconds > 0
    # A worker started after a reload (one Gunicorn started in place of a dead one) serves what
    # its siblings serve. With the file polled, the file: it wins over a reload at the next poll.
    latest = shared.latest() if shared is not None and not polled_config else None
    configs = configs_from_document(latest.document, settings, RELOAD) if latest else model_configs(settings)
    registry = ModelRegistry(configs[0].name)
    live = registry.live_config = LiveConfig(registry, settings, metrics, on_broken=on_broken, loading=loading)
    if latest is not None:
        _number, error = live.apply_generation(latest)
        log.info("started with model config generation %d, the newest reload's", latest.number)
        if error:  # as in the siblings, which answered the reload with it: the rest is served
            log.error("model config generation %d applied in part: %s", latest.number, error)
    else:
        for config in configs:
            live.serve(config)
        live.requested = configs
    if settings.model_poll_seconds > 0 and (polled_config or shared is not None or live.versioned_configs()):
        # Under Gunicorn always: a reload may add a versioned model, in any worker.
        registry.poller = VersionPoller(live, settings.model_poll_seconds)
    if polled_config:
        registry.config_poller = ConfigPoller(live, settings, settings.model_config_poll_seconds)
    if shared is not None:
        live.shared = shared
        shared.listen(live.apply_generation)
    return registry
