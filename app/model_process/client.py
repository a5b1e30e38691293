"""The worker's side of MODEL_PROCESSES: a registry whose batchers live in a model process.

The request layer (app/core/serving.py) and the front doors use the same `ModelRegistry` and
`Servable` as in the default mode, filled from the model process's description: versions,
labels, states and signatures are resolved and checked here, in the worker. Only the
batcher is remote: `RemoteBatcher` is an `Engine` (app/core/batching/engine.py) whose `submit`
hands the call, serialized once in the frame's header, and its rows to the model process; its
answer is waited for as any engine's, until the call's deadline. Nothing here imports TensorFlow.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from app.core.batching import BatchResult, Engine, EngineInfo, Tensors
from app.core.batching.batcher import given_ms
from app.core.call import Call
from app.core.errors import DeadlineExceeded
from app.core.models import ModelLoadError
from app.core.registry import END, ConfigEdit, ModelRegistry, Servable
from app.model_process import meta, protos
from app.model_process.link import ModelProcessLink, batch_result
from app.model_process.supervisor import FOLDER_VARIABLE, socket_path
from app.ops.settings import Settings

log = logging.getLogger(__name__)


class RemoteRegistry(ModelRegistry):
    """The registry of the default mode, but a change of the model config (a reload, or v2's
    repository load and unload) is the model processes' to apply."""

    link: ModelProcessLink | None = None

    def __init__(self, default_name: str) -> None:
        super().__init__(default_name)
        # Each model's MODEL_CONFIG entry, as its model process last described it.
        self.entries: dict[str, dict[str, Any]] = {}

    def config_entry(self, name: str) -> dict[str, Any] | None:
        return self.entries.get(name)

    def flush(self, *, later_too: bool = False) -> None:
        """A stop was asked (the worker's when_stopping): this worker's rows wait out no batch window."""
        if self.link is not None:
            self.link.stopping()

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        super().close(drain=drain, timeout_s=timeout_s)
        if self.link is not None:
            self.link.drain(timeout_s)

    def reload_config(self, document: dict[str, Any], *, timeout_s: float | None) -> None:
        """Applied by every model process, and by each of their workers, before it returns."""
        self._reload({"document": document}, timeout_s)

    def edit_config(self, edit: ConfigEdit, *, timeout_s: float | None) -> None:
        """As reload_config: the model processes make the document, from the config they serve."""
        self._reload({"edit": dataclasses.asdict(edit)}, timeout_s)

    def _reload(self, change: dict[str, Any], timeout_s: float | None) -> None:
        assert self.link is not None, "init_app() first"
        if timeout_s is not None and timeout_s >= threading.TIMEOUT_MAX:
            timeout_s = None  # gRPC reports a call without a deadline as one 2**63 ns away: no limit
        future = self.link.request({"op": "reload", **change, "timeout_s": timeout_s})
        try:
            future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded("the model processes had not applied the model config within the call's "
                                   "deadline; they go on") from None


class HangUps:
    """Tells the model process when the client of a request it holds leaves, so that it drops the
    rows unrun, as the default mode's batch thread does when it asks client_gone. Its batch thread
    cannot ask the worker's sockets: the worker watches them instead, an HTTP client's in one epoll
    set (one thread per worker, woken only by a hang-up) and a gRPC call through its context."""

    def __init__(self, link: ModelProcessLink) -> None:
        self._link = link
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[int, Callable[[], bool]]] = {}  # socket fd: (request id, client_gone)
        threading.Thread(target=self._run, name="client-hang-ups", daemon=True).start()

    def watch(self, client_gone: Callable[[], bool], request_id: int) -> Callable[[], None]:
        """Until the call it returns, the client of `client_gone` leaving cancels `request_id`."""
        sock = getattr(client_gone, "sock", None)
        if sock is not None:
            fd = sock.fileno()
            with self._lock:
                self._watched[fd] = (request_id, client_gone)
                # Level-triggered: a client gone before this line is reported at once.
                self._epoll.register(fd, select.EPOLLRDHUP)
            return lambda: self._unwatch(fd)
        context = getattr(client_gone, "context", None)
        if context is None:
            return lambda: None
        answered = threading.Event()

        def ended() -> None:
            if not answered.is_set():
                self._link.cancel(request_id)

        # A gRPC call's callbacks run once its handler is done: answered by then, or cancelled.
        context.add_done_callback(lambda _context: ended())
        return answered.set

    def _unwatch(self, fd: int) -> None:
        with self._lock:
            if self._watched.pop(fd, None) is not None:
                self._epoll.unregister(fd)

    def _run(self) -> None:
        while True:
            for fd, _events in self._epoll.poll():
                with self._lock:
                    watched = self._watched.get(fd)
                    # Asked again: an event read just before its request ended may name an fd
                    # that another connection's request has taken since.
                    if watched is None or not watched[1]():
                        continue
                    del self._watched[fd]
                    self._epoll.unregister(fd)
                self._link.cancel(watched[0])


class _RemoteAnswer(concurrent.futures.Future[BatchResult]):
    """A model process's answer, and the watch on its client to end once it came or was given up."""

    unwatch: Callable[[], None] | None = None

    def stop_watching(self) -> None:
        unwatch, self.unwatch = self.unwatch, None
        if unwatch is not None:
            unwatch()


class RemoteBatcher:
    """A batcher in the model process, as the worker's registry and request layer see it (an Engine)."""

    def __init__(self, link: ModelProcessLink, model: str, version: int, signature: str, info: EngineInfo,
                 hang_ups: HangUps) -> None:
        self.link = link
        self.hang_ups = hang_ups
        self.model = model
        self.version = version
        self.signature = signature
        self.info = info
        self.key = meta.batcher_key(model, version, signature)
        # A model process that is down is restarting: not ready, but this worker is alive.
        self.broken = False

    @property
    def alive(self) -> bool:
        return self.link.up

    # Queues and counts live in the model process: asked there (for /readyz, not per request).
    @property
    def queued_rows(self) -> int:
        return self.link.stats().get(self.key, [0, 0])[0]

    @property
    def batches_run(self) -> int:
        return self.link.stats().get(self.key, [0, 0])[1]

    def submit(self, call: Call, inputs: Tensors) -> concurrent.futures.Future[BatchResult]:
        """Send the call, serialized once in the frame's header, and its rows; the future holds the
        model process's answer. A client gone before the rows leave the worker: cancelled at once.
        The model process's batcher refuses rows over the limit, as this worker's front door did."""
        answer = _RemoteAnswer()
        client_gone = call.client_gone
        if client_gone is not None and client_gone():
            answer.cancel()  # the layer answers ClientGone (499)
            return answer
        header = {"op": "predict", "model": self.model, "version": self.version, "signature": self.signature,
                  "call": call.frame()}
        request_id, sent = self.link.send_request(header, inputs)
        if client_gone is not None:
            answer.unwatch = self.hang_ups.watch(client_gone, request_id)

        def arrived(future: concurrent.futures.Future[Any]) -> None:
            answer.stop_watching()
            if future.cancelled():
                answer.cancel()
                return
            try:
                got = future.result()
                if call.trace is not None:
                    # The start of the model process's predict call: where the queue-wait span ends.
                    call.trace.predict_started_ns = got[0].get("predict_started_ns")
                answer.set_result(batch_result(got))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                answer.set_exception(exc)

        sent.add_done_callback(arrived)
        return answer

    def give_up(self, future: concurrent.futures.Future[BatchResult], call: Call, waited_s: float | None,
                ) -> BatchResult:
        """The model process drops the rows at the same deadline, if they have not run."""
        if future.done():
            return future.result()
        if isinstance(future, _RemoteAnswer):
            future.stop_watching()  # its connection may serve the client's next request meanwhile
        raise DeadlineExceeded(f"no result from model '{self.info.name}' within {given_ms(call, waited_s)} ms")

    def flush(self, *, later_too: bool = False) -> None:
        """Nothing here: a stopping worker's link flushes its rows in the model process (stopping())."""

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Nothing to stop here: the link drains the requests of the whole worker (shutdown_app)."""


class RemoteModels:
    """Keeps a worker's registry in line with what its model process serves."""

    def __init__(self, registry: ModelRegistry, link: ModelProcessLink) -> None:
        self.registry = registry
        self.link = link
        self.hang_ups = HangUps(link)
        self._lock = threading.Lock()
        # Versions this worker could not serve, though the model process does: their handler
        # cannot be imported here. At start they stop the worker (connect).
        self.load_errors: list[str] = []

    def apply(self, description: dict[str, Any]) -> Callable[[], None]:
        """Serve what the description says; returns a wait until the versions it drops are gone."""
        with self._lock:
            retiring = []
            served = {entry["name"] for entry in description["models"]}
            for entry in description["models"]:
                retiring += self._apply_model(entry)
            for name, _ in self.registry.items():
                if name not in served:
                    retiring += [(name, version) for version in self.registry.versions(name)]
            self.registry.default_name = description["default"]
        threads = [threading.Thread(target=self.registry.retire, args=(name, version), daemon=True)
                   for name, version in retiring]
        for thread in threads:
            # Retiring waits for the requests inside the version: never on the link's reader thread.
            thread.start()

        def retired() -> None:
            for thread in threads:
                thread.join()

        return retired

    def _apply_model(self, entry: dict[str, Any]) -> list[tuple[str, int]]:
        name = entry["name"]
        served = set(self.registry.versions(name))
        wanted = {version["version"]: version for version in entry["versions"]}
        for number, version in wanted.items():
            if number not in served:
                try:
                    self.registry.add(self._servable(name, version))
                except ModelLoadError as exc:
                    log.error("model '%s' v%d is not served by this worker: %s", name, number, exc)
                    self.load_errors.append(f"model '{name}' v{number}: {exc}")
                    self.registry.set_state(name, number, END, str(exc)[:1000])
        self.registry.set_labels(name, {label: int(version) for label, version in entry["labels"].items()})
        if isinstance(self.registry, RemoteRegistry) and entry.get("config") is not None:
            self.registry.entries[name] = entry["config"]
        for state in entry["states"]:
            number = int(state["version"])
            if number not in served and number not in wanted:
                self.registry.set_state(name, number, state["state"], state["status"]["error_message"])
        return [(name, number) for number in served if number not in wanted]

    def _servable(self, name: str, version: dict[str, Any]) -> Servable:
        batchers: dict[str, Engine] = {
            key: RemoteBatcher(self.link, name, version["version"], key, EngineInfo(**info), self.hang_ups)
            for key, info in version["batchers"].items()}
        return Servable(meta.loaded_model(name, version), batchers, meta.handled(version, name))


def connect(settings: Settings) -> RemoteRegistry:
    """The worker's registry, filled from its model process (the first connection waits for it)."""
    # Before gRPC's front door (post_worker_init) imports TF Serving's protos.
    protos.without_tensorflow()
    folder = os.environ[FOLDER_VARIABLE]
    # Workers spread over the model processes by pid: with one model process, all share it.
    path = socket_path(folder, os.getpid() % settings.model_processes)
    registry = RemoteRegistry("")
    holder: list[RemoteModels] = []
    link = ModelProcessLink(path, arena_bytes=settings.model_process_arena_mb << 20,
                            on_meta=lambda description: holder[0].apply(description))
    remote = RemoteModels(registry, link)
    holder.append(remote)
    remote.apply(link.connect())
    if remote.load_errors:
        link.close()
        raise ModelLoadError("; ".join(remote.load_errors))
    registry.link = link
    return registry
