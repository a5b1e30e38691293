"""The hand-off between a worker and a model process, without either: the arena and the frames."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from app.core import errors
from app.model_process import wire
from app.model_process.arena import ALIGNMENT, Arena
from app.model_process.link import rebuild_error
from tests.conftest import wait_for


@pytest.fixture
def arena():
    made = Arena.create(16 * ALIGNMENT)
    yield made
    made.close()


def test_freed_blocks_join_so_a_large_block_fits_again(arena):
    blocks = [arena.allocate(4 * ALIGNMENT) for _ in range(4)]
    assert blocks == [0, 4 * ALIGNMENT, 8 * ALIGNMENT, 12 * ALIGNMENT]
    assert arena.allocate(1) is None
    for offset in (blocks[1], blocks[3], blocks[0], blocks[2]):
        arena.free(offset)
    assert arena.used_bytes == 0
    assert arena.allocate(16 * ALIGNMENT) == 0


def test_arrays_cross_in_the_arena_and_strings_and_overflow_in_the_payload(arena):
    sender_side = Arena(_shared_fd(arena))
    box = wire.Outbox(sender_side)
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    large = np.arange(1000, dtype=np.int64)  # 8,000 bytes: more than the arena's 1,024
    text = np.array([b"a", b"", "h\u00e9llo".encode()], dtype=object)
    descriptions = box.pack({"small": small, "large": large, "text": text})
    assert [("block" in item, "inline" in item) for item in descriptions] == [(True, False), (False, True),
                                                                              (False, True)]
    arrays = wire.unpack(descriptions, arena, b"".join(box.payload), copy=True)
    assert np.array_equal(arrays["small"], small) and arrays["small"].dtype == np.float32
    assert np.array_equal(arrays["large"], large)
    assert arrays["text"].tolist() == text.tolist()
    assert wire.blocks(descriptions) == box.blocks
    box.release()
    assert sender_side.used_bytes == 0
    sender_side.close()


def test_frames_and_descriptors_cross_a_unix_socket(arena):
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        wire.send_descriptor(left, arena.descriptor)
        received = Arena(wire.receive_descriptor(right))
        arena.buffer[:5] = b"hello"
        assert bytes(received.buffer[:5]) == b"hello"
        received.close()
        wire.send(left, threading.Lock(), {"op": "x", "shape": np.array([2, 3])}, [b"payload"])
        stream = right.makefile("rb")
        assert wire.receive(stream) == ({"op": "x", "shape": [2, 3]}, b"payload")
        left.close()
        assert wire.receive(stream) is None
        stream.close()


class _Socket:
    """What a Writer uses of a socket: each write recorded; the first held until `go` is set."""

    def __init__(self, *, fail: bool = False) -> None:
        self.writes: list[bytes] = []
        self.go = threading.Event()
        self.fail = fail
        self.closed = threading.Event()

    def sendall(self, data: bytes) -> None:
        self.writes.append(data)
        if self.fail:
            raise BrokenPipeError("the peer is gone")
        self.go.wait(30)

    def close(self) -> None:
        self.closed.set()


def test_frames_queued_while_the_writer_writes_leave_together_in_order():
    sock = _Socket()
    writer = wire.Writer(sock, "test-writer")  # type: ignore[arg-type]
    writer.put(b"a")
    wait_for(lambda: sock.writes, what="the first write")
    for message in (b"b", b"c", b"d"):
        writer.put(message)
    sock.go.set()
    assert writer.flush(30)
    assert sock.writes == [b"a", b"bcd"]
    assert not sock.closed.is_set()


def test_a_stopped_writer_writes_what_was_queued_before_it_closes_the_socket():
    sock = _Socket()
    writer = wire.Writer(sock, "test-writer")  # type: ignore[arg-type]
    writer.put(b"a")
    wait_for(lambda: sock.writes, what="the first write")
    writer.put(b"b")
    writer.stop()
    writer.put(b"after the stop")
    sock.go.set()
    assert sock.closed.wait(30)
    assert sock.writes == [b"a", b"b"]


def test_after_a_failed_write_frames_are_dropped_without_blocking_and_stop_closes():
    sock = _Socket(fail=True)
    writer = wire.Writer(sock, "test-writer")  # type: ignore[arg-type]
    writer.put(b"a")
    wait_for(lambda: writer.failed, what="the failed write")
    writer.put(b"b")
    assert writer.flush(30)
    assert sock.writes == [b"a"]
    assert not sock.closed.is_set()  # the connection's reader may still read from it
    writer.stop()
    assert sock.closed.wait(30)


@pytest.mark.parametrize(("name", "raised", "status", "headers"), [
    ("QueueFull", errors.QueueFull, 503, {"Retry-After": "3"}),
    ("DeadlineExceeded", errors.DeadlineExceeded, 504, {}),
    ("NotFound", errors.NotFound, 404, {}),
    ("SignatureNotFound", errors.SignatureNotFound, 400, {}),
    ("RuntimeError", errors.PredictFailed, 500, {}),  # not a ServingError: the model raised it
])
def test_a_model_process_error_is_raised_in_the_worker_as_the_same_class(name, raised, status, headers):
    error = rebuild_error({"error": name, "message": "words", "key": "k", "retry_after": "3"})
    assert type(error) is raised
    assert (error.status_code, error.message, error.headers) == (status, "words", headers)


def _shared_fd(arena: Arena) -> int:
    return os.dup(arena.descriptor)
