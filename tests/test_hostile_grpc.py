"""Hostile clients on the gRPC port of a live Gunicorn worker: raw HTTP/2 (the h2 package), loopback only.

Each attack is bounded in connections, calls and time, and runs inside tests/grpc_ledger.py's
`siege`: the worker's pid is unchanged, its health Check and a normal Predict answer while the
attack holds, its resident memory stays within a bound of where it started, and each call the
attack made has exactly one access line and one count, with the status its client got.
"""

from __future__ import annotations

import os
import re
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import (
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from tests.conftest import REPO, SERVER_COMMAND, Server, integer_rows, wait_for
from tests.grpc_ledger import siege

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
IDLE_CONNECTIONS = 1000
LOW_FD_LIMIT = 1024
SOCKET_TIMEOUT_S = 10
RECEIVE_TIMEOUT_MS = 2000
# MAX_QUEUE_ROWS + 2 x MAX_BATCH_SIZE: 24 threads, so 24 call slots; 6 streams per connection.
SMALL = {"MAX_QUEUE_ROWS": "16", "MAX_BATCH_SIZE": "4"}
THREADS = 24
STREAMS = {"GRPC_MAX_STREAMS_PER_CONNECTION": str(THREADS // 4)}


class LimitedServer(Server):
    """A Server whose Gunicorn starts under RLIMIT_NOFILE (soft, hard), as `ulimit -n` would set it."""

    def __init__(self, *args, fd_limits: tuple[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fd_limits = fd_limits

    def start(self, *, workers: int = 1, ready_within_s: float = 180) -> Server:
        command = [sys.executable, "-m", *SERVER_COMMAND, f"--workers={workers}", *self.args]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, cwd=REPO, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, self.fd_limits))
        self.wait_ready(workers=workers, within_s=ready_within_s)
        return self


def worker_pid(server: Server) -> int:
    return requests.get(server.url + "/readyz", timeout=10).json()["pid"]


def predict(server: Server, rows: np.ndarray) -> list[list[float]]:
    with grpc.insecure_channel(server.grpc_target) as channel:
        return predict_on(channel, rows)


def predict_on(channel: grpc.Channel, rows: np.ndarray) -> list[list[float]]:
    import tensorflow as tf

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "default"
    request.inputs["features"].CopyFrom(tf.make_tensor_proto(rows))
    answer = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    return tf.make_ndarray(answer.outputs["scores"]).tolist()


def hold_prefaces(port: int, count: int) -> list[socket.socket]:
    """`count` connections that send the HTTP/2 preface and an empty SETTINGS, then nothing."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)
        sock.sendall(PREFACE + EMPTY_SETTINGS)
        held.append(sock)
    return held


def open_server_side(sockets: list[socket.socket]) -> int:
    """How many of `sockets` the server still holds open (not closed by it, as far as reads tell)."""
    alive = 0
    for sock in sockets:
        sock.setblocking(False)
        try:
            while sock.recv(65536):
                pass
            continue  # b"": the server closed it
        except BlockingIOError:
            alive += 1
        except OSError:
            continue
    return alive


class PlainEncoder(hpack.Encoder):
    """HPACK with literal strings only: hpack's Huffman coding, in pure Python, spent seconds of
    CPU on the 4 MiB of metadata below; the server reads either, and its limits count decoded
    bytes."""

    def encode(self, headers, huffman: bool = False) -> bytes:
        return super().encode(headers, huffman=False)


class RawH2:
    """One raw HTTP/2 client connection, speaking gRPC's framing by hand."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.encoder = PlainEncoder()
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.events: list = []
        self.settings = {}
        self.read_until(lambda: self.settings, within_s=10)

    def headers_only(self, path: str, extra: tuple = ()) -> int:
        stream = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream, [(":method", "POST"), (":scheme", "http"), (":path", path),
                                        (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers"),
                                        *extra])
        self.sock.sendall(self.conn.data_to_send())
        return stream

    def read_until(self, done, *, within_s: float):
        deadline = time.monotonic() + within_s
        self.sock.settimeout(0.2)
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {within_s} s; events {self.events}")
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise ConnectionError(f"closed by the server; events {self.events}")
            for event in self.conn.receive_data(data):
                self.events.append(event)
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    self.settings.update({code: change.new_value for code, change in event.changed_settings.items()})
            out = self.conn.data_to_send()
            if out:
                self.sock.sendall(out)
        return done()

    def status(self, stream: int) -> str | None:
        """grpc-status of `stream` once its trailers (or trailers-only answer) arrived."""
        for event in self.events:
            if isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)) \
                    and event.stream_id == stream:
                found = dict(event.headers).get("grpc-status")
                if found is not None:
                    return found
        return None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def default_server(tmp_path_factory, exact_model_path):
    """The defaults: no per-connection stream limit, and GRPC_MAX_CONNECTIONS derived from the
    descriptor limit. Started as `ulimit -Sn 512 -Hn 1024` would leave it: the master raises the
    soft limit to the hard one, so the worker derives 1024 // 4 connections, not 512 // 4."""
    server = LimitedServer(tmp_path_factory.mktemp("grpc-defaults"), {"MODEL_PATH": str(exact_model_path), **SMALL},
                           fd_limits=(LOW_FD_LIMIT // 2, LOW_FD_LIMIT))
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory, exact_model_path):
    # Under a low descriptor limit, with a gRPC connection limit above it: held connections can
    # take every descriptor (the last test here); no other test here opens more than a few.
    server = LimitedServer(tmp_path_factory.mktemp("hostile-grpc"), {
        "MODEL_PATH": str(exact_model_path), "GRPC_RECEIVE_TIMEOUT_MS": str(RECEIVE_TIMEOUT_MS),
        "GRPC_MAX_CONNECTIONS": "5000", **SMALL, **STREAMS}, fd_limits=(LOW_FD_LIMIT, LOW_FD_LIMIT))
    yield server.start()
    server.stop()


# -- connections: descriptors, idle connections, the accept loop ---------------------------

def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(default_server):
    limits = open(f"/proc/{worker_pid(default_server)}/limits").read()
    [line] = [line for line in limits.splitlines() if line.startswith("Max open files")]
    assert line.split()[3:5] == [str(LOW_FD_LIMIT), str(LOW_FD_LIMIT)]


def test_idle_prefaces_under_a_low_descriptor_limit_leave_rest_and_grpc_serving(default_server, exact_model):
    server = default_server
    held: list[socket.socket] = []
    try:
        # The siege's channel connects before the attack, as a kept channel's would.
        with siege(server, exact_model) as watch:
            port = int(server.grpc_target.rsplit(":", 1)[1])
            held = hold_prefaces(port, IDLE_CONNECTIONS)
            # GRPC_MAX_CONNECTIONS derived: 1024 // 4 = 256 a worker, the siege's among them; the rest are closed.
            wait_for(lambda: open_server_side(held) <= LOW_FD_LIMIT // 4, within_s=30, what="connections capped")
            rows = integer_rows(3, seed=31)
            answer = requests.post(server.url + "/predict", json={"instances": rows.tolist()}, timeout=30)
            assert answer.status_code == 200
            assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
            watch.serving()
            assert requests.get(server.url + "/healthz", timeout=10).status_code == 200
            # The gauge is sampled once a second: a sample from before the held connections reads 1.
            wait_for(lambda: server.metric("model_server_connections", protocol="grpc") == LOW_FD_LIMIT // 4,
                     within_s=10, what="the gRPC connection gauge at the cap")
            for sock in held:
                sock.close()
    finally:
        for sock in held:
            sock.close()
    assert "Too many open files" not in server.log()
    # The server is shared: the next test's connections must not meet a cap still held by these.
    wait_for(lambda: server.metric("model_server_connections", protocol="grpc") == 0, within_s=30,
             what="the held connections closed")


# -- streams: headers without a message, Health's own capacity -------------------------------

def test_by_default_a_connection_serves_call_after_call(default_server, exact_model):
    """With a per-connection stream limit set by default, grpc 1.85 refused every call of a
    connection after a few (RST_STREAM REFUSED_STREAM): closed-loop clients saw 99 % errors."""
    client = RawH2(default_server.grpc_target)
    try:
        assert h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS not in client.settings
    finally:
        client.close()
    rows = integer_rows(2, seed=34)
    expected = exact_model(rows).numpy().tolist()
    with grpc.insecure_channel(default_server.grpc_target) as channel:
        answers = [predict_on(channel, rows) for _ in range(40)]
    assert answers == [expected] * 40


PREDICT = "/tensorflow.serving.PredictionService/Predict"
HEALTH = "/grpc.health.v1.Health/Check"
MODEL_STATUS = "/tensorflow.serving.ModelService/GetModelStatus"


def test_limits_are_advertised_in_settings(small_server):
    client = RawH2(small_server.grpc_target)
    try:
        assert client.settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] == THREADS // 4
        assert client.settings[h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE] == 16 * 1024
    finally:
        client.close()


def test_headers_only_streams_cannot_lock_out_health_and_are_cancelled(small_server, exact_model):
    per_connection = THREADS // 4
    with siege(small_server, exact_model) as watch:
        # Every call slot held by a stream that never sends its message.
        clients = [RawH2(small_server.grpc_target) for _ in range(THREADS // per_connection + 1)]
        try:
            streams = [(client, client.headers_only(PREDICT)) for client in clients for _ in range(per_connection)]
            started = time.monotonic()
            # The probe answers at once: Health has its own threads, outside the call limit.
            # A Predict has no slot by design until the held streams are cancelled.
            watch.serving(predict=False)
            assert time.monotonic() - started < RECEIVE_TIMEOUT_MS / 1000
            # The streams past the THREADS call slots were refused at once; the held ones are
            # cancelled once GRPC_RECEIVE_TIMEOUT_MS has passed.
            for client, stream in streams:
                client.read_until(lambda client=client, stream=stream: client.status(stream),
                                  within_s=RECEIVE_TIMEOUT_MS / 1000 + 10)
            statuses = sorted(client.status(stream) for client, stream in streams)
            assert statuses == sorted([str(grpc.StatusCode.CANCELLED.value[0])] * THREADS
                                      + [str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])] * per_connection)
            watch.got(PREDICT, grpc.StatusCode.CANCELLED, THREADS)
            watch.got(PREDICT, grpc.StatusCode.RESOURCE_EXHAUSTED, per_connection)
            # The slots are free again; the attackers' connections stay open.
            watch.serving()
        finally:
            for client in clients:
                client.close()


def test_headers_only_health_calls_hold_a_thread_for_at_most_a_second(small_server, exact_model):
    with siege(small_server, exact_model) as watch:
        client = RawH2(small_server.grpc_target)
        try:
            stalled = [client.headers_only(HEALTH) for _ in range(THREADS // 4)]
            watch.serving()
            for stream in stalled:
                client.read_until(lambda stream=stream: client.status(stream), within_s=5)
                assert client.status(stream) == str(grpc.StatusCode.CANCELLED.value[0])
        finally:
            client.close()
        # Health checks are the probes' calls: no access line, no count (as /healthz over HTTP).


@pytest.mark.parametrize("size", [64 * 1024, 4 * 1024 * 1024], ids=["64KiB", "4MiB"])
def test_metadata_over_the_advertised_size_is_refused(small_server, exact_model, size):
    with siege(small_server, exact_model) as watch:
        client = RawH2(small_server.grpc_target)
        try:
            # Headers of 16 KiB each, the advertised limit's size: HEADERS and CONTINUATION frames.
            big = client.headers_only(PREDICT, tuple((f"x-big-{index}", "a" * (16 * 1024 - 64))
                                                     for index in range(max(1, size // (16 * 1024)))))
            client.read_until(lambda: client.status(big), within_s=30)
            assert client.status(big) == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
        finally:
            client.close()
        # grpc-core answers the client itself, then hands the call to the server already
        # cancelled, without saying why: its one line and count say CANCELLED (docs/reliability.md).
        watch.got(PREDICT, grpc.StatusCode.CANCELLED)
        watch.serving()


def test_a_message_that_does_not_parse_is_invalid_argument(small_server, exact_model):
    with siege(small_server, exact_model) as watch, grpc.insecure_channel(small_server.grpc_target) as channel:
        raw = channel.unary_unary(PREDICT, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as raised:
            raw(b"\xff\xff\xff\xff not a PredictRequest", timeout=10)
        watch.got(PREDICT, raised.value.code())
        watch.serving()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "the request message does not parse"
    assert "Exception deserializing" not in small_server.log()


MULTI_INFERENCE = "/tensorflow.serving.PredictionService/MultiInference"
UNPARSEABLE_MULTI_INFERENCE = [
    # (id, message bytes, details)
    ("garbage", b"\x0a\xff\xff\xff\x7f tasks that never end", "the request message does not parse"),
    # A task whose model_spec field claims more bytes than the message holds.
    ("truncated task", b"\x0a\x10\x0a\x0e\x0a\x07default", "the request message does not parse"),
    ("no tasks", b"", "ModelSpec has no name specified."),
]


@pytest.mark.parametrize("message, words", [case[1:] for case in UNPARSEABLE_MULTI_INFERENCE],
                         ids=[case[0] for case in UNPARSEABLE_MULTI_INFERENCE])
def test_an_unparseable_multi_inference_is_invalid_argument(small_server, exact_model, message, words):
    with siege(small_server, exact_model) as watch, grpc.insecure_channel(small_server.grpc_target) as channel:
        raw = channel.unary_unary(MULTI_INFERENCE, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as raised:
            raw(message, timeout=10)
        watch.got(MULTI_INFERENCE, raised.value.code())
        watch.serving()
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, words)


FORGED_IDS = [
    # (id, the x-request-id a client sends)
    ("log line", "x status=OK 2026-11-25T00:00:00.000+00:00 INFO [1] app.access: access method=GRPC"),
    ("too long", "a" * 129),
    ("spaces", "abc def"),
    ("quote and equals", 'id"=x'),
]


@pytest.mark.parametrize("forged", [case[1] for case in FORGED_IDS], ids=[case[0] for case in FORGED_IDS])
def test_a_forged_request_id_is_replaced_and_logged_once(small_server, exact_model, forged):
    with siege(small_server, exact_model) as watch, grpc.insecure_channel(small_server.grpc_target) as channel:
        stub = model_service_pb2_grpc.ModelServiceStub(channel)
        _, call = stub.GetModelStatus.with_call(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "default"}), timeout=10,
            metadata=(("x-request-id", forged),))
        given = dict(call.initial_metadata())["x-request-id"]
        watch.got(MODEL_STATUS, grpc.StatusCode.OK)
        watch.serving()
    assert given != forged and re.fullmatch("[0-9a-f]{32}", given)
    lines = watch.ledger.lines()
    assert [line["status"] for line in lines if line["request_id"] == given] == ["OK"]
    assert "access method=GRPC" not in "".join(line["request_id"] for line in lines)


# -- rapid resets: streams opened and reset at once ---------------------------------------------

RAPID_RESETS = 50_000
RAPID_RESET_WITHIN_S = 120
RAPID_RESET_RECOVERY_S = 60


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def reset_storm(target: str, count: int, *, within_s: float) -> int:
    """Open and reset `count` Predict streams, HEADERS then RST_STREAM(CANCEL), on as many
    connections as the server leaves open; the number sent within `within_s`."""
    host, port = target.rsplit(":", 1)
    block = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PREDICT),
                                    (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
    headers_flags, cancel = 0x4, struct.pack(">I", 8)  # END_HEADERS; CANCEL
    sent, deadline = 0, time.monotonic() + within_s
    while sent < count and time.monotonic() < deadline:
        with socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S) as sock:
            drain = threading.Thread(target=_drain, args=(sock,), daemon=True)
            drain.start()
            try:
                sock.sendall(PREFACE + EMPTY_SETTINGS)
                stream = 1
                while sent < count and time.monotonic() < deadline and stream < 2**31 - 1000:
                    burst = b"".join(frame(0x1, headers_flags, stream + 2 * i, block)
                                     + frame(0x3, 0, stream + 2 * i, cancel) for i in range(500))
                    sock.sendall(burst)
                    stream += 1000
                    sent += 500
            except OSError:
                pass  # the server ended the connection: go on with a new one
            sock.shutdown(socket.SHUT_RDWR)
        drain.join(timeout=SOCKET_TIMEOUT_S)
    return sent


def _drain(sock: socket.socket) -> None:
    """Read what the server sends, so that its writes never stall on a full socket."""
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass


def test_rapid_resets_leave_the_worker_serving(default_server, exact_model):
    # Calls reset before or after they reach the server's code: no client can count them.
    with siege(default_server, exact_model, ledger=False) as watch:
        sent = reset_storm(default_server.grpc_target, RAPID_RESETS, within_s=RAPID_RESET_WITHIN_S)
        # Health answers at once. grpc-core refuses new calls (CANCELLED, RESOURCE_EXHAUSTED)
        # until the server has worked through the calls the storm left queued: seconds.
        watch.serving(recover_within_s=RAPID_RESET_RECOVERY_S)
    assert sent == RAPID_RESETS


# -- descriptors run out -----------------------------------------------------------------------

def test_out_of_descriptors_the_worker_backs_off_and_stays(small_server, exact_model):
    # A gRPC connection limit above the descriptor limit: the held connections take every descriptor.
    # Last of the module: should the worker not survive, no other test reads its server.
    server = small_server
    held: list[socket.socket] = []
    try:
        with siege(server, exact_model) as watch:
            port = int(server.grpc_target.rsplit(":", 1)[1])
            held = hold_prefaces(port, IDLE_CONNECTIONS + 100)
            wait_for(lambda: len(os.listdir(f"/proc/{watch.pid}/fd")) >= LOW_FD_LIMIT - 1, within_s=30,
                     what="the worker out of descriptors")
            # Health on a connection made before needs no descriptor. A Predict now ended the
            # worker in a run: a C++ std::random_device found no descriptor for /dev/urandom, and
            # the process aborted (docs/reliability.md); it is asked once descriptors are back.
            watch.serving(predict=False)
            # A REST connection the worker cannot accept now: it waits in the backlog.
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as waiting:
                waiting.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                wait_for(lambda: "accept failed (Too many open files)" in server.log(), within_s=30,
                         what="the worker backing off")
                for sock in held:
                    sock.close()
                held = []
                # Descriptors come back: the waiting connection is accepted and answered.
                answer = waiting.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200 ")
            watch.serving()
            rows = integer_rows(2, seed=32)
            assert predict(server, rows) == exact_model(rows).numpy().tolist()
            watch.got(PREDICT, grpc.StatusCode.OK)
    finally:
        for sock in held:
            sock.close()
    # One worker for the server's whole run: none exited and was replaced.
    assert server.log().count("Booting worker") == 1
