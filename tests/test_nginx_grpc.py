"""deploy/nginx/nginx.conf's gRPC front, a real nginx before a live Gunicorn's gRPC port.

TensorFlow Serving's own stubs (tensorflow-serving-api) call through it and get the model's
exact values; hostile HTTP/2 clients (the h2 package, by hand) are cut by nginx: calls past
the per-address limit are refused with RESOURCE_EXHAUSTED while others are served, a stream
that sends headers and no message is ended by nginx's body timeout, an idle connection gets
a GOAWAY, and a connection that opens and resets streams without end gets a GOAWAY after
keepalive_requests streams. After each attack the worker's pid is unchanged.

Limited clients connect from 127.0.0.2 (all of 127.0.0.0/8 is loopback on Linux): the config
leaves 127.0.0.1, the pod's own processes, unlimited. The worker's own receive timeout is
raised to a minute, so that only nginx can end a silent stream within the test's bound.
"""

from __future__ import annotations

import re
import shutil
import socket
import time

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import numpy as np
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.conftest import REPO, Server, integer_rows
from tests.nginx_front import Nginx

PER_ADDRESS = 64
STREAMS_PER_CONNECTION = 32
STREAMS_BEFORE_GOAWAY = 1000
PREDICT = "/tensorflow.serving.PredictionService/Predict"
HEALTH = "/grpc.health.v1.Health/Check"
# gRPC's framing of an empty message (a HealthCheckRequest with no service): flag 0, length 0.
EMPTY_MESSAGE = b"\x00\x00\x00\x00\x00"
SOCKET_TIMEOUT_S = 10
# The test's idle timeout in place of the shipped 60 s (GRPC_CONNECTION_IDLE_MS).
IDLE_S = 2
# Bounds on waits for what nginx must do; never timings the test asserts.
WITHIN_S = 30
# Past client_body_timeout (5 s), short of grpc_send_timeout (10 s), which also ends a silent call.
BODY_TIMEOUT_BOUND_S = 8


@pytest.fixture(autouse=True, scope="module")
def nginx_installed() -> None:
    assert shutil.which("nginx"), "the nginx binary is needed (.ci/run installs Debian's package)"


@pytest.fixture(scope="module")
def gunicorn(tmp_path_factory, exact_model_path):
    server = Server(tmp_path_factory.mktemp("nginx-grpc-upstream"),
                    {"MODEL_PATH": str(exact_model_path), "GRPC_RECEIVE_TIMEOUT_MS": "60000"})
    yield server.start()
    server.stop()


def start_front(tmp_path_factory, gunicorn: Server, overrides: dict[str, str] | None = None) -> Nginx:
    return Nginx(tmp_path_factory.mktemp("nginx-grpc"), upstream_port=gunicorn.port, overrides=overrides,
                 grpc_upstream_port=int(gunicorn.grpc_target.rsplit(":", 1)[1])).start()


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, gunicorn):
    front = start_front(tmp_path_factory, gunicorn, {"keepalive_timeout": f"{IDLE_S}s"})
    yield front
    front.stop()


@pytest.fixture
def same_worker(gunicorn):
    """The worker that served before the test still serves after it."""
    pid = requests.get(gunicorn.url + "/readyz", timeout=10).json()["pid"]
    yield
    assert requests.get(gunicorn.url + "/readyz", timeout=10).json()["pid"] == pid


def predict(target: str, rows: np.ndarray) -> list[list[float]]:
    import tensorflow as tf

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "default"
    request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
    with grpc.insecure_channel(target) as channel:
        answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    return tf.make_ndarray(answer.outputs["scores"]).tolist()


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


class RawH2:
    """One raw HTTP/2 connection to the front, from `source` (an address of 127.0.0.0/8)."""

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.sock = socket.socket()
        self.sock.settimeout(SOCKET_TIMEOUT_S)
        self.sock.bind((source, 0))
        self.sock.connect(("127.0.0.1", port))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.flush()
        self.events: list[h2.events.Event] = []
        self.pending = b""

    def flush(self) -> None:
        if data := self.conn.data_to_send():
            self.sock.sendall(data)

    def headers_only(self, path: str = PREDICT) -> int:
        """A call's headers, no message and no end of stream: the call waits for its message."""
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                        (":authority", "x"), ("content-type", "application/grpc"),
                                        ("te", "trailers")])
        return stream

    def read_until(self, done, *, within_s: float = WITHIN_S):
        """Read frames until done(events) is true; False if the peer closed before that."""
        deadline = time.monotonic() + within_s
        while not done(self.events):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise TimeoutError(f"not done within {within_s} s; events {self.events[-5:]}") from None
            except ConnectionResetError:
                return False
            if not data:
                return False
            self.receive(data)
        return True

    def receive(self, data: bytes) -> None:
        """Hand h2 one whole frame at a time, none after a GOAWAY: h2's connection is closed
        then, and frames still in flight behind it would raise."""
        self.pending += data
        while len(self.pending) >= 9 and goaway(self.events) is None:
            size = 9 + int.from_bytes(self.pending[:3], "big")
            if len(self.pending) < size:
                break
            frame, self.pending = self.pending[:size], self.pending[size:]
            self.events.extend(self.conn.receive_data(frame))
        self.flush()

    def read_ready(self) -> None:
        """Whatever frames have arrived, without waiting for more."""
        self.sock.setblocking(False)
        try:
            while data := self.sock.recv(65536):
                self.receive(data)
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(SOCKET_TIMEOUT_S)

    def close(self) -> None:
        self.sock.close()


def ended(stream: int):
    return lambda events: any(isinstance(e, (h2.events.StreamReset, h2.events.StreamEnded)) and e.stream_id == stream
                              for e in events)


def goaway(events) -> h2.events.ConnectionTerminated | None:
    return next((e for e in events if isinstance(e, h2.events.ConnectionTerminated)), None)


def grpc_status(events, stream: int) -> dict[str, str]:
    """The grpc-status and grpc-message a trailers-only answer (or the trailers) carried."""
    for event in events:
        if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)) and event.stream_id == stream:
            headers = dict(event.headers)
            if "grpc-status" in headers:
                return {k: headers[k] for k in ("grpc-status", "grpc-message")}
    return {}


# ---------------------------------------------------------------------------- the shipped front


def test_the_shipped_grpc_limits_are_what_the_docs_say():
    from app.ops.settings import Settings

    text = (REPO / "deploy" / "nginx" / "nginx.conf").read_text()
    front = text[text.index("listen 8500 http2;"):]
    settings = Settings()
    assert f"limit_conn grpc_per_client {PER_ADDRESS};" in front
    assert f"http2_max_concurrent_streams {STREAMS_PER_CONNECTION};" in front
    assert f"keepalive_requests {STREAMS_BEFORE_GOAWAY};" in front
    # The idle GOAWAY and the header list size are the server's own defaults.
    assert f"keepalive_timeout {int(settings.grpc_connection_idle_ms / 1000)}s;" in front
    assert f"large_client_header_buffers 1 {settings.grpc_max_metadata_bytes // 1024}k;" in front
    # nginx's read timeout outlasts the server's deadline, so the server's status comes first.
    [read_timeout] = re.findall(r"grpc_read_timeout (\d+)s;", front)
    assert int(read_timeout) * 1000 > settings.request_timeout_ms
    # The workers' gRPC port is on loopback, behind the front.
    assert "server 127.0.0.1:8510;" in text


def test_predict_and_health_through_the_front_give_exact_answers(nginx, exact_model):
    rows = integer_rows(5, seed=51)
    assert predict(nginx.grpc_target, rows) == exact_model(rows).numpy().tolist()
    assert health(nginx.grpc_target) == health_pb2.HealthCheckResponse.SERVING


def test_the_servers_own_errors_pass_through(nginx):
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "no-such-model"
    with grpc.insecure_channel(nginx.grpc_target) as channel, pytest.raises(grpc.RpcError) as caught:
        prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in caught.value.details()


def test_upstream_down_is_unavailable(tmp_path, gunicorn):
    # A free port nobody listens on, in place of the workers' gRPC port.
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    front = Nginx(tmp_path, upstream_port=gunicorn.port, grpc_upstream_port=port).start()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            health(front.grpc_target)
    finally:
        front.stop()
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details() == "the model server is not answering; retry later"


def test_metadata_past_16_kib_is_refused_by_nginx_and_less_passes(nginx):
    # Two 9,000-byte values: each field fits a 16 KiB buffer, the header list does not. nginx
    # ends the connection (GOAWAY ENHANCE_YOUR_CALM): the client sees UNAVAILABLE, where the
    # worker itself would answer RESOURCE_EXHAUSTED.
    with grpc.insecure_channel(nginx.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(), timeout=10, metadata=[("x-a", "a" * 9000), ("x-b", "b" * 9000)])
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "GOAWAY" in caught.value.details()
    with grpc.insecure_channel(nginx.grpc_target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10,
                                                            metadata=[("x-a", "a" * 7000), ("x-b", "b" * 7000)])
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------------------- hostile clients


def test_one_address_holds_at_most_its_calls_and_others_are_served(tmp_path_factory, gunicorn, exact_model,
                                                                   same_worker):
    # The held calls must outlast the checks: the body timeout is raised for this front only.
    front = start_front(tmp_path_factory, gunicorn, {"client_body_timeout": "60s"})
    held = [RawH2(front.grpc_port, "127.0.0.2") for _ in range(PER_ADDRESS // STREAMS_PER_CONNECTION)]
    try:
        for client in held:
            streams = {client.headers_only() for _ in range(STREAMS_PER_CONNECTION)}
            client.flush()
            # nginx opens a stream's window once it has taken the call in (and counted it).
            client.read_until(lambda events, streams=streams: streams <= {
                e.stream_id for e in events if isinstance(e, h2.events.WindowUpdated)})
        # The next call from that address, a whole one, is refused by nginx as a gRPC status.
        extra = RawH2(front.grpc_port, "127.0.0.2")
        stream = extra.headers_only(HEALTH)
        extra.conn.send_data(stream, EMPTY_MESSAGE, end_stream=True)
        extra.flush()
        extra.read_until(lambda events: grpc_status(events, stream))
        assert grpc_status(extra.events, stream) == {
            "grpc-status": str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]),
            "grpc-message": "too many calls from this address; retry later"}
        # The held calls are still open, and another address is served meanwhile.
        assert not any(isinstance(e, (h2.events.StreamReset, h2.events.StreamEnded)) for c in held for e in c.events)
        rows = integer_rows(3, seed=52)
        assert predict(front.grpc_target, rows) == exact_model(rows).numpy().tolist()
        assert health(front.grpc_target) == health_pb2.HealthCheckResponse.SERVING
        extra.close()
    finally:
        for client in held:
            client.close()
        front.stop()


def test_a_silent_call_and_an_idle_connection_are_ended_by_nginx(nginx, same_worker):
    # Side by side, so that the test waits out the longer of nginx's two timeouts, not both.
    caller = RawH2(nginx.grpc_port, "127.0.0.2")
    idle = RawH2(nginx.grpc_port, "127.0.0.2")
    try:
        stream = caller.headers_only()
        caller.flush()
        sent = time.monotonic()
        # The idle one sent the preface and SETTINGS, then nothing: nginx sends GOAWAY and closes.
        assert idle.read_until(goaway), f"closed without a GOAWAY; events {idle.events}"
        assert goaway(idle.events).error_code == h2.errors.ErrorCodes.NO_ERROR
        # The call's headers, then no message: client_body_timeout (5 s) ends it, before
        # grpc_send_timeout (10 s) would; the worker's own receive timeout is a minute here.
        assert caller.read_until(ended(stream))
        assert time.monotonic() - sent < BODY_TIMEOUT_BOUND_S
    finally:
        caller.close()
        idle.close()
    assert health(nginx.grpc_target) == health_pb2.HealthCheckResponse.SERVING


def test_rapid_resets_get_a_goaway_after_keepalive_requests_streams(nginx, exact_model, same_worker):
    client = RawH2(nginx.grpc_port)
    opened = 0
    try:
        # HEADERS then RST_STREAM, over and over (CVE-2023-44487), 10 streams a burst; a PING
        # after each, and its ACK awaited, so that nginx reads one burst at a time (fewer new
        # streams in one read than its per-read limit, which the next test meets).
        while goaway(client.events) is None and opened < 3 * STREAMS_BEFORE_GOAWAY:
            reset_streams(client, 10)
            opened += 10
            mark = opened.to_bytes(8, "big")
            client.conn.ping(mark)
            client.flush()
            client.read_until(lambda events, mark=mark: goaway(events) or any(
                isinstance(e, h2.events.PingAckReceived) and e.ping_data == mark for e in events))
    finally:
        client.close()
    terminated = goaway(client.events)
    assert terminated is not None, f"no GOAWAY after {opened} streams"
    assert terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    # Client streams are odd: the 1,000th is 1,999, and nginx took none after it.
    assert (opened, terminated.last_stream_id) == (STREAMS_BEFORE_GOAWAY, 2 * STREAMS_BEFORE_GOAWAY - 1)
    rows = integer_rows(2, seed=53)
    assert predict(nginx.grpc_target, rows) == exact_model(rows).numpy().tolist()


def test_a_burst_of_resets_in_one_read_gets_a_goaway_at_once(nginx, same_worker):
    # Debian's CVE-2023-44487 fix in nginx 1.22.1 (as nginx 1.25.3's): more than twice
    # http2_max_concurrent_streams new streams in one read are refused, and a connection with
    # more than 100 refused streams is sent away. 200 resets in one write meet both.
    client = RawH2(nginx.grpc_port)
    try:
        reset_streams(client, 200)
        client.flush()
        client.read_until(goaway)
    finally:
        client.close()
    terminated = goaway(client.events)
    assert terminated is not None, f"no GOAWAY; events {client.events[-5:]}"
    assert terminated.error_code == h2.errors.ErrorCodes.NO_ERROR
    assert terminated.last_stream_id < 2 * 200 - 1
    assert health(nginx.grpc_target) == health_pb2.HealthCheckResponse.SERVING


def reset_streams(client: RawH2, count: int) -> None:
    for _ in range(count):
        client.conn.reset_stream(client.headers_only(), h2.errors.ErrorCodes.CANCEL)
