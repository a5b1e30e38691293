"""A worker's link to its model process: requests out, one reader thread resolving their futures.

`submit()` packs a request's arrays into this worker's arena and sends one frame; the
reader thread reads each answer, copies its outputs out of the model process's arena, and
settles the request's future. Blocks are freed by their writer: an input block when its
answer comes back (the model process has done with it by then), an output block once read,
told to the model process with this worker's next frame.

A description the model process pushes with an `ack` (after a reload) is answered
"applied" once this worker's registry serves it. A worker that begins to stop calls
`stopping()`: its requests in the model process, and those it still sends, wait for no
batch window.

When the model process dies the reader sees the socket end: every request in flight fails
at once with Unavailable (503), new ones are refused the same way, and a thread connects
again, with backoff, until the restarted process serves.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from app.core import errors
from app.core.batching import BatchResult
from app.core.batching.work import settle
from app.model_process import wire
from app.model_process.arena import Arena

log = logging.getLogger(__name__)

RECONNECT_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class _Request:
    __slots__ = ("future", "blocks")

    def __init__(self, blocks: list[int]) -> None:
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.blocks = blocks


class _Connection:
    """One connected socket with its two arenas; replaced whole when the model process restarts."""

    def __init__(self, path: str, arena_bytes: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
            self.outbox = Arena.create(arena_bytes)
            wire.send_descriptor(self.sock, self.outbox.descriptor)
            self.outbox.drop_descriptor()
            self.inbox = Arena(wire.receive_descriptor(self.sock))
        except BaseException:
            self.sock.close()
            raise
        self.send_lock = threading.Lock()
        self.stream = self.sock.makefile("rb", buffering=1 << 16)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class ModelProcessLink:
    """Requests to one model process, answered through futures; `on_meta` hears of model changes."""

    def __init__(self, path: str, *, arena_bytes: int,
                 on_meta: Callable[[dict[str, Any]], Callable[[], None] | None]) -> None:
        self.path = path
        self.arena_bytes = arena_bytes
        self.on_meta = on_meta
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending: dict[int, _Request] = {}
        self._read_blocks: list[int] = []
        self._connection: _Connection | None = None
        self._closed = threading.Event()
        self._reconnecting = False
        self._stopping = False

    # -- life ---------------------------------------------------------------------------------

    def connect(self) -> dict[str, Any]:
        """Connect and return the model process's description of its models."""
        connection = _Connection(self.path, self.arena_bytes)
        with self._lock:
            self._connection = connection
        threading.Thread(target=self._read, args=(connection,), name="model-process-reader", daemon=True).start()
        header, _ = self.request({"op": "describe"}).result()
        return header["meta"]

    @property
    def up(self) -> bool:
        return self._connection is not None

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every request sent has its answer (a stopping worker), then close."""
        with self._idle:
            self._idle.wait_for(lambda: not self._pending, timeout_s)
        self.close()

    def stopping(self) -> None:
        """This worker stops: what it sent runs now, and so will what it still sends (no batch window)."""
        self._stopping = True
        try:
            self.request({"op": "flush"})
        except errors.ServingError:
            pass  # the model process is restarting: nothing of ours waits there

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def stats(self, timeout_s: float = 5.0) -> dict[str, list[int]]:
        """Rows queued and batches run of each batcher in the model process; {} while it is down."""
        try:
            header, _ = self.request({"op": "stats"}).result(timeout_s)
        except (errors.ServingError, concurrent.futures.TimeoutError):
            return {}
        return header["stats"]

    # -- requests ------------------------------------------------------------------------------

    def request(self, header: dict[str, Any], arrays: Mapping[str, np.ndarray] | None = None,
                ) -> concurrent.futures.Future[Any]:
        """Send one frame; its future resolves to the answer's (header, outputs), or fails."""
        return self.send_request(header, arrays)[1]

    def cancel(self, request_id: int) -> None:
        """Tell the model process a request's client has left: it drops the rows if they have not run
        (the request's own answer says which). Nothing is sent while it is down: nothing of ours waits there."""
        connection = self._connection
        if connection is None:
            return
        try:
            wire.send(connection.sock, connection.send_lock, {"op": "cancel", "cancel": request_id})
        except OSError:
            pass  # the reader fails the request with the rest

    def send_request(self, header: dict[str, Any], arrays: Mapping[str, np.ndarray] | None = None,
                     ) -> tuple[int, concurrent.futures.Future[Any]]:
        """request(), and the id that cancel() names the request by."""
        with self._lock:
            connection = self._connection
            if connection is None:
                raise errors.Unavailable("the model process is restarting; retry")
            box = wire.Outbox(connection.outbox)
            request_id = next(self._ids)
            entry = _Request(box.blocks)
            self._pending[request_id] = entry
            header["free"], self._read_blocks = self._read_blocks, []
        header["id"] = request_id
        if self._stopping:
            header["flush"] = True
        try:
            if arrays is not None:
                header["inputs"] = box.pack(arrays)
            wire.send(connection.sock, connection.send_lock, header, box.payload)
        except OSError:
            # The reader fails it with the rest, once it sees the connection end.
            pass
        except BaseException:
            with self._lock:
                self._pending.pop(request_id, None)
            box.release()
            raise
        return request_id, entry.future

    # -- the reader thread -----------------------------------------------------------------------

    def _read(self, connection: _Connection) -> None:
        try:
            while (frame := wire.receive(connection.stream)) is not None:
                self._answer(connection, *frame)
        except (OSError, ValueError):
            pass
        finally:
            self._lost(connection)

    def _answer(self, connection: _Connection, header: dict[str, Any], payload: bytes) -> None:
        if header["op"] == "described" and header["id"] is None:
            applied = self.on_meta(header["meta"])
            if "ack" in header:
                # Waiting for it may wait for answers this thread reads: another thread acknowledges.
                threading.Thread(target=self._acknowledge, args=(connection, header["ack"], applied),
                                 name="model-process-ack", daemon=True).start()
            return
        with self._lock:
            entry = self._pending.pop(header["id"], None)
            if not self._pending:
                self._idle.notify_all()
        if entry is None:
            return
        for offset in entry.blocks:
            connection.outbox.free(offset)
        if header["op"] == "error":
            settle(entry.future, exception=rebuild_error(header))
            return
        outputs = wire.unpack(header.get("outputs", []), connection.inbox, payload, copy=True)
        with self._lock:
            self._read_blocks.extend(wire.blocks(header.get("outputs", [])))
        settle(entry.future, result=(header, outputs))

    def _acknowledge(self, connection: _Connection, token: int, applied: Callable[[], None] | None) -> None:
        if applied is not None:
            applied()
        try:
            wire.send(connection.sock, connection.send_lock, {"op": "applied", "ack": token})
        except OSError:
            pass  # the model process is gone: its reload failed with it

    def _lost(self, connection: _Connection) -> None:
        with self._lock:
            if self._connection is connection:
                self._connection = None
            failed, self._pending = self._pending, {}
            self._read_blocks = []
            self._idle.notify_all()
            # One thread reconnects; a connection lost while it tries is its to retry.
            reconnect, self._reconnecting = not self._reconnecting, True
        error = errors.Unavailable("the model process serving this request exited; retry")
        for entry in failed.values():
            settle(entry.future, exception=error)
        connection.close()
        connection.outbox.close()
        connection.inbox.close()
        if reconnect and not self._closed.is_set():
            log.error("model process at %s is gone; %d requests failed; reconnecting", self.path, len(failed))
            threading.Thread(target=self._reconnect, name="model-process-reconnect", daemon=True).start()

    def _reconnect(self) -> None:
        for attempt in itertools.count():
            if self._closed.wait(RECONNECT_BACKOFF_S[min(attempt, len(RECONNECT_BACKOFF_S) - 1)]):
                return
            try:
                meta = self.connect()
            except (OSError, errors.ServingError):
                continue
            with self._lock:
                self._reconnecting = False
            log.info("model process at %s serves again", self.path)
            self.on_meta(meta)
            return


def rebuild_error(header: dict[str, Any]) -> errors.ServingError:
    """The model process's error as this worker raises it: same class, same message."""
    kind = getattr(errors, header["error"], None)
    message = header["message"]
    if not (isinstance(kind, type) and issubclass(kind, errors.ServingError)):
        return errors.PredictFailed(message, detail=header.get("detail"))
    if issubclass(kind, errors.PredictFailed):
        return kind(message, detail=header.get("detail"))
    if issubclass(kind, errors.Unavailable):
        return kind(message, retry_after_s=int(header.get("retry_after") or 1))
    if issubclass(kind, errors.SignatureNotFound):
        return kind(message, key=header.get("key", ""))
    return kind(message)


def batch_result(answer: tuple[dict[str, Any], dict[str, np.ndarray]]) -> BatchResult:
    header, outputs = answer
    return BatchResult(outputs, header["batch_rows"], header["batch_requests"])
