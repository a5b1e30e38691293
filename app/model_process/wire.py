"""What a worker and a model process say to each other over their Unix socket.

A frame is a fixed head (header length, payload length), a JSON header, and a payload.
Arrays go into the sender's arena and the header names their block; an array that does not
fit, and every string array, travels in the payload instead. Nothing is pickled: a header
holds only names, dtypes, shapes and offsets.

The first exchange of a connection is one byte each way, each carrying the sender's arena
descriptor (SCM_RIGHTS); frames follow.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import numpy as np
import orjson

from app.model_process.arena import Arena

HEAD = struct.Struct("!IQ")
STRING = np.dtype(object)


class Readable(Protocol):
    def read(self, size: int = ..., /) -> bytes: ...


def frame(header: Mapping[str, Any], payload: Iterable[bytes] = ()) -> bytes:
    body = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    parts = list(payload)
    return b"".join([HEAD.pack(len(body), sum(len(part) for part in parts)), body, *parts])


def send(sock: socket.socket, lock: threading.Lock, header: Mapping[str, Any], payload: Iterable[bytes] = ()) -> None:
    """One frame; the lock keeps frames of several threads from interleaving."""
    message = frame(header, payload)
    with lock:
        sock.sendall(message)


class Writer:
    """Frames to one peer, written by a thread of their own: frames queued while it writes leave together.

    A batch's answers are settled one after another on its batch thread; queued here, they
    reach the peer in one write, and its reader wakes once for all of them instead of once each.
    `put` never blocks on the socket. Once a write fails (the peer is gone), frames are dropped.
    The writer owns the socket: its thread closes it after `stop`, once nothing can write to it.
    """

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock = sock
        self.failed = False
        self._frames: list[bytes] = []
        self._writing = False
        self._stopped = False
        self._changed = threading.Condition(threading.Lock())
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, message: bytes) -> None:
        with self._changed:
            if self._stopped or self.failed:
                return
            self._frames.append(message)
            if not self._writing and len(self._frames) == 1:
                self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every frame queued has been written (or dropped); False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not (self._frames or self._writing), timeout_s)

    def stop(self) -> None:
        """Write what is queued, then close the socket and end the thread."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()

    def _run(self) -> None:
        try:
            self._write()
        finally:
            with self._changed:
                self.failed = True
                self._frames = []
                self._writing = False
                self._changed.notify_all()
                self._changed.wait_for(lambda: self._stopped)
            self.sock.close()

    def _write(self) -> None:
        while True:
            with self._changed:
                self._writing = False
                self._changed.notify_all()  # flush() waiters
                self._changed.wait_for(lambda: self._frames or self._stopped)
                frames, self._frames = self._frames, []
                if not frames:
                    return  # stopped, nothing left
                self._writing = True
            try:
                self.sock.sendall(b"".join(frames) if len(frames) > 1 else frames[0])
            except OSError:
                return


def receive(stream: Readable) -> tuple[dict[str, Any], bytes] | None:
    """The next frame, or None once the peer has closed the connection (or died)."""
    head = stream.read(HEAD.size)
    if len(head) < HEAD.size:
        return None
    header_length, payload_length = HEAD.unpack(head)
    body = stream.read(header_length)
    payload = stream.read(payload_length) if payload_length else b""
    if len(body) < header_length or len(payload) < payload_length:
        return None
    return orjson.loads(body), payload


def send_descriptor(sock: socket.socket, fd: int) -> None:
    socket.send_fds(sock, [b"A"], [fd])


def receive_descriptor(sock: socket.socket) -> int:
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if not fds:
        raise ConnectionError("the peer closed the connection before it sent its arena")
    return fds[0]


def dtype_text(dtype: np.dtype) -> str:
    # Extension types (bfloat16 and the like) share one .str ('<V2'): their name tells them apart.
    return dtype.name if dtype.kind == "V" else dtype.str


def dtype_from_text(text: str) -> np.dtype:
    try:
        return np.dtype(text)
    except TypeError:
        import ml_dtypes  # TensorFlow's numpy extension types

        return np.dtype(getattr(ml_dtypes, text))


class Outbox:
    """Arrays being packed into one frame: blocks of the arena where they fit, the payload where not."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.blocks: list[int] = []
        self.payload: list[bytes] = []
        self._payload_bytes = 0

    def pack(self, arrays: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
        return [self._pack(name, np.asarray(array)) for name, array in arrays.items()]

    def _pack(self, name: str, array: np.ndarray) -> dict[str, Any]:
        description: dict[str, Any] = {"name": name, "dtype": dtype_text(array.dtype), "shape": array.shape}
        if array.dtype == STRING:
            lengths, data = _strings(array)
            description["lengths"] = self._inline(lengths.tobytes())
            description["inline"] = self._inline(data)
            return description
        array = np.ascontiguousarray(array)
        offset = self.arena.allocate(array.nbytes)
        if offset is None:
            description["inline"] = self._inline(array.tobytes())
            return description
        self.blocks.append(offset)
        np.frombuffer(self.arena.buffer, array.dtype, array.size, offset)[:] = array.reshape(-1)
        description["block"] = offset
        return description

    def _inline(self, data: bytes) -> int:
        offset = self._payload_bytes
        self.payload.append(data)
        self._payload_bytes += len(data)
        return offset

    def release(self) -> None:
        """Free the blocks of a frame that was never sent."""
        for offset in self.blocks:
            self.arena.free(offset)
        self.blocks = []


def unpack(descriptions: list[dict[str, Any]], arena: Arena, payload: bytes, *, copy: bool) -> dict[str, np.ndarray]:
    """The arrays a frame names: views of the peer's arena (copy=False) or copies of them."""
    return {description["name"]: _unpack(description, arena, payload, copy) for description in descriptions}


def blocks(descriptions: list[dict[str, Any]]) -> list[int]:
    return [description["block"] for description in descriptions if "block" in description]


def _unpack(description: dict[str, Any], arena: Arena, payload: bytes, copy: bool) -> np.ndarray:
    dtype = dtype_from_text(description["dtype"])
    shape = tuple(description["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == STRING:
        lengths = np.frombuffer(payload, np.int64, count, description["lengths"])
        return _from_strings(lengths, payload, description["inline"]).reshape(shape)
    if "block" in description:
        array = np.frombuffer(arena.buffer, dtype, count, description["block"]).reshape(shape)
        return array.copy() if copy else array
    return np.frombuffer(payload, dtype, count, description["inline"]).reshape(shape).copy()


def _strings(array: np.ndarray) -> tuple[np.ndarray, bytes]:
    items = [item if isinstance(item, bytes) else str(item).encode() for item in array.reshape(-1)]
    return np.array([len(item) for item in items], np.int64), b"".join(items)


def _from_strings(lengths: np.ndarray, payload: bytes, start: int) -> np.ndarray:
    out = np.empty(len(lengths), dtype=object)
    position = start
    for index, length in enumerate(lengths.tolist()):
        out[index] = payload[position:position + length]
        position += length
    return out
