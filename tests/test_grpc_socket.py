"""GRPC_SOCKET_PATH's hand-over between workers (app/grpc/socket.py) and GRPC_CHANNEL_ARGUMENTS'
precedence (app/grpc/limits.py), with real grpc servers on real Unix sockets in this process.

Two SocketOwners here stand for two workers: flock locks belong to an open file, so two opens
of PATH.lock in one process exclude each other as two processes' would.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from app.grpc import limits as grpc_limits
from app.grpc.socket import SocketOwner
from app.ops.settings import Settings, SettingsError


class HealthServer:
    """A started grpc server with Health only, on `bind`; `stop` as GrpcServer's."""

    def __init__(self, bind: str, *, before_stop: threading.Event | None = None) -> None:
        self.bind = bind
        self._before_stop = before_stop
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), self._server)
        self._server.add_insecure_port(bind)
        self._server.start()

    def stop(self, *, grace_s: float) -> threading.Event:
        if self._before_stop is not None:
            assert self._before_stop.wait(30), "the next owner never served"
        return self._server.stop(grace_s)


def check(path: str) -> int:
    with grpc.insecure_channel(f"unix:{path}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "tfs.sock")


def test_the_waiting_owner_takes_the_socket_over_and_the_first_ones_stop_leaves_it(path):
    second_serving = threading.Event()
    first = SocketOwner(path, lambda bind: HealthServer(bind, before_stop=second_serving)).start()
    assert first.serving.wait(30)
    second = SocketOwner(path, HealthServer).start()
    assert check(path) == health_pb2.HealthCheckResponse.SERVING
    assert not second.serving.is_set()  # waits: only one owner at a time

    stopping = threading.Thread(target=lambda: first.drain(timeout_s=10))
    stopping.start()
    assert second.serving.wait(30)
    second_serving.set()  # the first server stops only now, after the second one bound
    stopping.join(30)
    # grpc-core unlinks the path it bound when its server stops: the first owner's own name, not PATH.
    assert check(path) == health_pb2.HealthCheckResponse.SERVING
    assert second.drain(timeout_s=10)


def test_an_owner_that_stops_removes_its_socket_and_lock_is_free(path, tmp_path):
    owner = SocketOwner(path, HealthServer).start()
    assert owner.serving.wait(30)
    assert owner.drain(timeout_s=10)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["tfs.sock.lock"]
    after = SocketOwner(path, HealthServer).start()
    assert after.serving.wait(30)
    assert check(path) == health_pb2.HealthCheckResponse.SERVING
    after.drain(timeout_s=10)


def test_an_owner_stopped_while_waiting_never_serves(path):
    first = SocketOwner(path, HealthServer).start()
    assert first.serving.wait(30)
    waiting = SocketOwner(path, HealthServer).start()
    assert waiting.stop(grace_s=0).is_set()
    first.drain(timeout_s=10)
    waiting.thread.join(30)  # it took the lock, and gave it up without serving
    assert not waiting.thread.is_alive() and not waiting.serving.is_set()
    last = SocketOwner(path, HealthServer).start()
    assert last.serving.wait(30)  # the lock was passed on
    last.drain(timeout_s=10)


def options(**environ: str) -> dict[str, int | str]:
    settings = Settings.from_env(environ)
    listed = grpc_limits.channel_options(settings, max_bytes=1000)
    assert len({key for key, _ in listed}) == len(listed), "each key once"
    return dict(listed)


def test_a_channel_argument_replaces_the_servers_own_value_and_others_are_added():
    own = options()
    given = options(GRPC_CHANNEL_ARGUMENTS="grpc.max_receive_message_length=64, grpc.lb_policy_name=grpclb,"
                                           "grpc.max_connection_age_ms=9999999999,grpc.lb_policy_name=pick_first")
    assert (own["grpc.max_receive_message_length"], given["grpc.max_receive_message_length"]) == (1000, 64)
    # Not a 32-bit integer: passed as a string, as absl::SimpleAtoi's failure makes TF Serving do.
    # A key given twice: its first value, which grpc-core keeps of the duplicates TF Serving passes.
    assert (given["grpc.lb_policy_name"], given["grpc.max_connection_age_ms"]) == ("grpclb", "9999999999")
    assert {key: value for key, value in given.items() if key not in (
        "grpc.max_receive_message_length", "grpc.lb_policy_name", "grpc.max_connection_age_ms")} == {
        key: value for key, value in own.items() if key not in (
            "grpc.max_receive_message_length", "grpc.max_connection_age_ms")}


@pytest.mark.parametrize("text", ["grpc.max_connection_age_ms", "a=1=2", "=1", "a=1,,b=2", "grpc.so_reuseport=0"])
def test_channel_arguments_tf_serving_would_misread_are_refused(text):
    with pytest.raises(SettingsError, match=r"^GRPC_CHANNEL_ARGUMENTS=.* is not valid: expected TF Serving's "):
        Settings.from_env({"GRPC_CHANNEL_ARGUMENTS": text})


@pytest.mark.parametrize("limits, code", [((10, 100_000), grpc.StatusCode.RESOURCE_EXHAUSTED),
                                          ((100_000, 10), grpc.StatusCode.NOT_FOUND)])
def test_grpc_core_keeps_the_first_of_duplicate_arguments(limits, code):
    """What docs/tf-serving.md's precedence rests on: TF Serving passes its own message size before
    the user's arguments, and of a key given twice grpc-core applies the first value."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1),
                         options=[("grpc.max_receive_message_length", limit) for limit in limits])
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, pytest.raises(grpc.RpcError) as refused:
            # 1 KB: over the limit of 10 bytes, under 100,000 (then NOT_FOUND: no such service).
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="x" * 1000), timeout=10)
        assert refused.value.code() == code
    finally:
        server.stop(None)
