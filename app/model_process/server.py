"""The model process: loads the models once, runs their batchers, and serves workers over a Unix socket.

`python -m app.model_process.server --socket PATH --ready-fd N` loads and warms every model
through the same code a worker uses in the default mode (its own services, app/core/services.py:
versions, labels, pollers, warm-up), binds the socket, and only then writes `ready` to the
descriptor it was given. Each worker connection has one thread that reads its frames and
submits their rows to the batchers; an answer goes back from the batch thread's
done-callback, written into this process's arena for that worker.

A reload (a worker's HandleReloadConfigRequest) is applied here and, through the run folder
of app/core/shared_config.py, by every sibling model process; each pushes the new description to
its workers and waits until they applied it before the reload answers. A worker that stops
says so ("flush"): its requests queued here run without waiting out their batch window.

SIGTERM: stop accepting connections, answer everything submitted (the batchers drain),
then exit. A batch thread that dies ends the process the same way, and the supervisor
starts a fresh one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any, cast

from app.core import services
from app.core.batching import Batcher, BatchResult
from app.core.call import Call
from app.core.errors import ClientGone, PredictFailed, ServingError, Unavailable
from app.core.registry import ConfigEdit, ModelRegistry, Servable
from app.model_process import meta, wire
from app.model_process.arena import Arena
from app.ops import logs, runtime
from app.ops.settings import Settings
from app.wire import warmup

log = logging.getLogger(__name__)

_ACK_TOKENS = itertools.count(1)


class WorkerConnection:
    """One worker's connection: its frames in, answers out through this side's arena."""

    def __init__(self, sock: socket.socket, models: ModelRegistry, arena_bytes: int) -> None:
        self.sock = sock
        self.models = models
        self.inbox = Arena(wire.receive_descriptor(sock))
        self.outbox = Arena.create(arena_bytes)
        wire.send_descriptor(sock, self.outbox.descriptor)
        self.outbox.drop_descriptor()
        self.writer = wire.Writer(sock, "worker-connection-writer")
        self.closed = threading.Event()
        # Descriptions pushed and not yet acknowledged as applied by the worker.
        self._acks: dict[int, threading.Event] = {}
        # Whether the client of each request queued or running has left, by the worker's id: the
        # worker watches its clients and says so ('cancel'); the batch thread asks as it asks a
        # socket in the default mode, just before the request's first rows run.
        self._left: dict[int, threading.Event] = {}

    def serve(self) -> None:
        stream = self.sock.makefile("rb", buffering=1 << 16)
        try:
            while (frame := wire.receive(stream)) is not None:
                self._handle(*frame)
        except OSError:
            pass  # the worker went away mid-frame
        finally:
            self.closed.set()
            for acked in list(self._acks.values()):
                acked.set()  # a worker gone serves nothing: no reload waits for it
            stream.close()
            self.writer.stop()  # closes the socket once queued answers are written
            # Each arena's memory goes once nothing maps it: requests still running hold their
            # inputs, and an answer packed after this fails quietly (nobody reads it).
            self.inbox.close()
            self.outbox.close()

    def send(self, header: dict[str, Any], payload: list[bytes] | None = None) -> None:
        # Once the worker has died its requests still run, unanswered: the writer drops their frames.
        if not self.closed.is_set():
            self.writer.put(wire.frame(header, payload or ()))

    def _handle(self, header: dict[str, Any], payload: bytes) -> None:
        for offset in header.get("free", ()):
            self.outbox.free(offset)
        handler = self._handlers.get(header["op"])
        if handler is None:
            # A worker of another release, say: told so, rather than left waiting for an answer.
            self._error(header.get("id"), Unavailable(f"the model process has no operation {header['op']!r}"))
            return
        handler(self, header, payload)

    # -- what a worker's frames ask; each answers with the frame's id --------------------------------

    def _describe(self, header: dict[str, Any], _payload: bytes) -> None:
        self.send({"op": "described", "id": header["id"], "meta": meta.describe(self.models)})

    def _stats(self, header: dict[str, Any], _payload: bytes) -> None:
        self.send({"op": "stats", "id": header["id"], "stats": meta.batcher_stats(self.models)})

    def _flush(self, header: dict[str, Any], _payload: bytes) -> None:
        self.models.flush()
        self.send({"op": "flushed", "id": header["id"]})

    def _applied(self, header: dict[str, Any], _payload: bytes) -> None:
        self._acks.pop(header["ack"], threading.Event()).set()

    def _start_reload(self, header: dict[str, Any], _payload: bytes) -> None:
        # Loads take seconds: not on this connection's thread, which reads its predict frames.
        threading.Thread(target=self._reload, args=(header,), name="reload", daemon=True).start()

    def push(self, description: dict[str, Any]) -> threading.Event:
        """Send the worker a new description; the event is set once it has applied it (or is gone)."""
        token = next(_ACK_TOKENS)
        acked = self._acks[token] = threading.Event()
        self.send({"op": "described", "id": None, "meta": description, "ack": token})
        if self.closed.is_set():
            acked.set()
        return acked

    def _reload(self, header: dict[str, Any]) -> None:
        """A worker's HandleReloadConfigRequest (a document) or v2 repository load or unload (an
        edit of the config served here): applied here and by every sibling model process (the run
        folder of app/core/shared_config.py), each of which tells its workers before this answers."""
        try:
            if "edit" in header:
                self.models.edit_config(ConfigEdit(**header["edit"]), timeout_s=header["timeout_s"])
            else:
                self.models.reload_config(header["document"], timeout_s=header["timeout_s"])
        except Exception as exc:
            self._error(header["id"], exc)
            return
        self.send({"op": "reloaded", "id": header["id"]})

    def _predict(self, header: dict[str, Any], payload: bytes) -> None:
        request_id = header["id"]
        left = threading.Event()
        try:
            # The worker's call, with this side's client-gone check: the worker's `cancel` sets it.
            call = Call.from_frame(header["call"], signature=header["signature"], client_gone=left.is_set,
                                   trace=_linked_trace)
            # The version the worker resolved, or (retired since) the registry's one fallback.
            servable = self.models.enter(call, header["model"], header["version"], call.signature)
        except ServingError as exc:
            self._error(request_id, exc)
            return
        try:
            inputs = wire.unpack(header["inputs"], self.inbox, payload, copy=False)
            # The model process's registry holds its own batch threads.
            batcher = cast(Batcher, servable.batchers[servable.signature(call.signature).name])
            # In before the submit: its answer may come before the next line.
            self._left[request_id] = left
            future = batcher.submit(call, inputs)
            if header.get("flush"):
                batcher.flush()  # from a stopping worker: it waits for no company
        except Exception as exc:
            self._left.pop(request_id, None)
            servable.leave()
            self._error(request_id, exc)
            return
        future.add_done_callback(lambda done: self._answer(request_id, servable, done, call.trace))

    def _cancel(self, header: dict[str, Any], _payload: bytes) -> None:
        """The worker saw the request's client leave; no answer but the request's own."""
        left = self._left.get(header["cancel"])
        if left is not None:
            left.set()

    _handlers: dict[str, Callable[[WorkerConnection, dict[str, Any], bytes], None]] = {
        "predict": _predict, "describe": _describe, "stats": _stats, "flush": _flush, "applied": _applied,
        "reload": _start_reload, "cancel": _cancel,
    }

    def _answer(self, request_id: int, servable: Servable, future: concurrent.futures.Future[BatchResult],
                trace: Any = None) -> None:
        servable.leave()
        self._left.pop(request_id, None)
        try:
            result = future.result(0)
        except concurrent.futures.CancelledError:  # the batch thread's, for a client that left
            self._error(request_id, ClientGone("the client left before its request ran"))
            return
        except BaseException as exc:  # a failed or expired request: its error goes back
            self._error(request_id, exc)
            return
        box = wire.Outbox(self.outbox)
        try:
            outputs = box.pack(result.outputs)
        except Exception as exc:
            box.release()
            self._error(request_id, exc)
            return
        self.send({"op": "result", "id": request_id, "version": servable.model.version, "outputs": outputs,
                   "batch_rows": result.batch_rows, "batch_requests": result.batch_requests,
                   **({"predict_started_ns": trace.predict_started_ns} if trace is not None else {})}, box.payload)

    def _error(self, request_id: int | None, exc: BaseException) -> None:
        error = exc if isinstance(exc, ServingError) else PredictFailed.from_exception(exc)
        # The model's full error goes back too: the worker logs it on a line naming the request id.
        self.send({"op": "error", "id": request_id, "error": type(error).__name__, "message": error.message,
                   "key": getattr(error, "key", ""), "retry_after": error.headers.get("Retry-After"),
                   "detail": getattr(error, "detail", None)})


def _linked_trace(fields: list[Any]) -> Any:
    # Sent only with tracing on, so tracing is imported only then.
    from app.ops import tracing

    return tracing.LinkedTrace(fields)


class ModelProcess:
    """The models, the socket, and the connections of the workers."""

    def __init__(self, settings: Settings, socket_path: str, *, drain_s: float) -> None:
        self.settings = settings
        self.socket_path = socket_path
        self.drain_s = drain_s
        self.stopping = threading.Event()
        self.connections: list[WorkerConnection] = []
        # What the workers were last told the models are; one push at a time.
        self._described: dict[str, Any] = {}
        self._pushing = threading.Lock()
        self._listener: socket.socket | None = None

    def load(self) -> None:
        tensorflow = runtime.configure(self.settings, workers=self.settings.model_processes)
        # Loaded and warmed as in a worker of the default mode; a batch thread that dies stops this process.
        self.services = services.start(self.settings, warm_up=warmup.replay, replace_worker=self.stop)
        self.services.tensorflow.update(tensorflow)
        self.models = self.services.registry
        if self.models.live_config is not None:
            self.models.live_config.on_applied = self.tell_workers
        self._watch_versions()

    def listen(self) -> None:
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # left by the process this one replaces
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(256)
        self._listener = listener

    def serve(self) -> None:
        assert self._listener is not None, "listen() first"
        arena_bytes = self.settings.model_process_arena_mb << 20
        while not self.stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                break  # closed by stop()
            try:
                connection = WorkerConnection(sock, self.models, arena_bytes)
            except OSError:
                sock.close()
                continue
            self.connections = [known for known in self.connections if not known.closed.is_set()] + [connection]
            threading.Thread(target=connection.serve, name="worker-connection", daemon=True).start()

    def stop(self) -> None:
        """Take no new connection; the batchers then drain what was submitted (see main)."""
        self.stopping.set()
        if self._listener is not None:
            self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def close(self) -> None:
        self.models.close(drain=True, timeout_s=self.drain_s)
        # The drained batches' answers are queued with the writers: out before the process exits.
        for connection in self.connections:
            connection.writer.flush(self.drain_s)

    def tell_workers(self) -> None:
        """After a reload: push the new description to every worker and wait until each applied it,
        so that once the reload answers no worker resolves a request to what it no longer serves."""
        with self._pushing:
            self._described = description = meta.describe(self.models)
            waiting = [connection.push(description) for connection in list(self.connections)]
        for acked in waiting:
            if not acked.wait(self.drain_s):
                log.error("a worker had not applied the reloaded model config within %.0f s", self.drain_s)

    def _watch_versions(self) -> None:
        # Versions and configs change here (the pollers); workers learn it from a pushed description.
        interval = min(x for x in (self.settings.model_poll_seconds, self.settings.model_config_poll_seconds, 1.0)
                       if x > 0)
        if not (self.models.poller or self.models.config_poller):
            return
        threading.Thread(target=self._push_changes, args=(interval,), name="version-push", daemon=True).start()

    def _push_changes(self, interval: float) -> None:
        with self._pushing:
            self._described = meta.describe(self.models)
        while not self.stopping.wait(interval):
            with self._pushing:
                # Compared with the last description pushed, by this thread or by a reload.
                now = meta.describe(self.models)
                if now != self._described:
                    self._described = now
                    for connection in list(self.connections):
                        connection.send({"op": "described", "id": None, "meta": now})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--ready-fd", type=int, required=True)
    parser.add_argument("--drain-s", type=float, default=30.0, help="the longest a stop waits for the batchers")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    logs.configure_logging(settings.log_level, settings.log_format)
    process = ModelProcess(settings, args.socket, drain_s=args.drain_s)
    # Until the models are loaded a stop has nothing to drain: the default handler ends the process.
    process.load()
    runtime.freeze_heap()
    process.listen()
    signal.signal(signal.SIGTERM, lambda *_: process.stop())
    os.write(args.ready_fd, b"ready")
    os.close(args.ready_fd)
    log.info("model process %d serving %s on %s", os.getpid(), [name for name, _ in process.models.items()],
             args.socket)
    process.serve()
    process.close()
    log.info("model process %d stopped", os.getpid())


if __name__ == "__main__":
    main()
