"""A gRPC call is logged and counted with the status its client got (app/grpc/exchange.py).

A live worker whose predict calls can be held inside the model, past the engine's last look
at their client (tests/gunicorn_test_hooks.py's PREDICT_GATE): while a call is held its
client cancels, or its deadline passes; then the call is let go, and its handler returns an
answer nobody receives. Each test holds the client's status against the call's one access
line and the change in model_server_requests_total.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import struct
import time
from concurrent import futures

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest
from prometheus_client import CollectorRegistry
from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc, prediction_service_pb2_grpc

from app.core.exchange import Exchanges
from app.grpc import calls as grpc_calls
from app.ops import logs
from app.ops.metrics import Metrics
from tests.conftest import Server, integer_rows, wait_for
from tests.grpc_ledger import PREDICT, Ledger
from tests.gunicorn_test_hooks import GATE_RELEASE, GATE_VALUE
from tests.test_grpc import predict_request, scores

TEST_HOOKS = ("-c", "tests/gunicorn_test_hooks.py")
STATUS = "/tensorflow.serving.ModelService/GetModelStatus"
CLIENT_DEADLINE_S = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    gate = tmp_path_factory.mktemp("gate")
    running = Server(tmp_path_factory.mktemp("grpc-truth"), {
        "MODEL_PATH": str(exact_model_path), "PREDICT_GATE": str(gate), "LOG_FORMAT": "json"}, args=TEST_HOOKS)
    running.gate = gate
    yield running.start()
    running.stop()


def gated_rows(seed: int):
    rows = integer_rows(2, seed=seed)
    rows[0, 0] = GATE_VALUE  # an integer: the model's answer stays exact
    return rows


def held(server: Server) -> int:
    """The pid of the worker holding a predict call in its model, once one is held."""
    [marker] = wait_for(lambda: list(server.gate.glob("held-*")), what="a predict call held")
    return int(marker.name.split("-")[1])


def round_trip(channel: grpc.Channel) -> None:
    """A call on `channel` after what the test sent on it: the server reads a connection in
    order, so once this is answered it has seen everything sent before (a cancel included)."""
    model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
        get_model_status_pb2.GetModelStatusRequest(model_spec={"name": "default"}), timeout=30)


def line_of(ledger: Ledger, request_id: str) -> dict[str, str]:
    [line] = [line for line in ledger.lines() if line["request_id"] == request_id]
    return line


def test_a_held_call_answered_is_logged_ok(server, exact_model):
    ledger = Ledger(server)
    rows = gated_rows(1)
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict.future(
            predict_request("default", rows), timeout=60, metadata=(("x-request-id", "held-answered"),))
        os.kill(held(server), GATE_RELEASE)
        assert scores(call.result()).tolist() == exact_model(rows).numpy().tolist()
    ledger.settle(collections.Counter({(PREDICT, "OK"): 1}))
    assert line_of(ledger, "held-answered")["status"] == "OK"


def test_a_call_its_client_cancelled_while_its_rows_ran_is_logged_and_counted_cancelled(server):
    ledger = Ledger(server)
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict.future(
            predict_request("default", gated_rows(2)), timeout=60, metadata=(("x-request-id", "left-mid-call"),))
        pid = held(server)
        assert call.cancel()
        round_trip(channel)
        # The rows run to their end and the handler returns its answer: the client is gone.
        os.kill(pid, GATE_RELEASE)
    assert call.code() == grpc.StatusCode.CANCELLED
    ledger.settle(collections.Counter({(PREDICT, "CANCELLED"): 1, (STATUS, "OK"): 1}))
    assert line_of(ledger, "left-mid-call")["status"] == "CANCELLED"


def test_a_call_whose_deadline_passed_while_its_rows_ran_is_logged_and_counted_deadline_exceeded(server):
    ledger = Ledger(server)
    with grpc.insecure_channel(server.grpc_target) as channel:
        call = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict.future(
            predict_request("default", gated_rows(3)), timeout=CLIENT_DEADLINE_S,
            metadata=(("x-request-id", "late-mid-call"),))
        pid = held(server)
        # The client's own deadline ends its wait while the model still holds the rows.
        assert call.exception(timeout=CLIENT_DEADLINE_S + 30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        os.kill(pid, GATE_RELEASE)
    ledger.settle(collections.Counter({(PREDICT, "DEADLINE_EXCEEDED"): 1}))
    assert line_of(ledger, "late-mid-call")["status"] == "DEADLINE_EXCEEDED"


def unread_predict(target: str, rows, *, timeout: str, headers: tuple = ()) -> dict[str, str]:
    """A Predict whose client grants the server no flow-control window, so that no answer's
    message can be sent: the trailers that end it (its deadline's, `timeout` as grpc-timeout)."""
    host, port = target.rsplit(":", 1)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    conn.local_settings = h2.settings.Settings(client=True,
                                               initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    conn.initiate_connection()
    body = predict_request("default", rows).SerializeToString()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", PREDICT), (":authority", "x"),
                          ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", timeout),
                          *headers])
    conn.send_data(1, b"\x00" + struct.pack(">I", len(body)) + body, end_stream=True)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "no status within 30 s"
            data = sock.recv(65536)
            assert data, "closed by the server before a status"
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.TrailersReceived):
                    return dict(event.headers)
            sock.sendall(conn.data_to_send())


def test_an_answer_still_unsent_at_the_deadline_is_logged_and_counted_deadline_exceeded(server):
    """The handler answers at once; the client reads nothing, so the answer waits in the
    server until the call's deadline ends it, and the client gets DEADLINE_EXCEEDED."""
    ledger = Ledger(server)
    trailers = unread_predict(server.grpc_target, integer_rows(2, seed=4), timeout="2S",
                              headers=(("x-request-id", "never-read"),))
    assert trailers["grpc-status"] == str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
    ledger.settle(collections.Counter({(PREDICT, "DEADLINE_EXCEEDED"): 1}))
    assert line_of(ledger, "never-read")["status"] == "DEADLINE_EXCEEDED"


# -- in one process: an answer that cannot be serialized ---------------------------------------

class _Unserializable(grpc.GenericRpcHandler):
    def service(self, details):
        return grpc.unary_unary_rpc_method_handler(lambda request, context: object(),
                                                   response_serializer=lambda response: response.SerializeToString())


class _Lines(logging.Handler):
    """The access lines themselves, on app.access: an earlier test's logging set-up (a
    dictConfig in this process) may have disabled that logger or cut it off from the root
    logger, where caplog listens."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.fields: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.fields.append(record.fields)  # type: ignore[attr-defined]

    def __call__(self) -> list[dict]:
        logs.flush_access_log()
        return self.fields


def test_an_answer_that_cannot_be_serialized_is_logged_internal():
    metrics = Metrics(CollectorRegistry())

    async def call() -> grpc.aio.AioRpcError:
        threads = futures.ThreadPoolExecutor(max_workers=2)
        path = grpc_calls.CallPath(Exchanges(metrics), max_calls=2, receive_timeout_s=30, threads=threads)
        server = grpc.aio.server(interceptors=[path])
        server.add_generic_rpc_handlers((_Unserializable(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await channel.unary_unary("/test.Service/Answer")(b"", timeout=30,
                                                                     metadata=(("x-request-id", "unserializable"),))
                return raised.value
        finally:
            await server.stop(None)
            threads.shutdown()

    lines, access = _Lines(), logging.getLogger("app.access")
    level, disabled = access.level, access.disabled
    access.addHandler(lines)
    access.setLevel(logging.INFO)
    access.disabled = False
    try:
        refused = asyncio.run(call())
        # The record counts the call, then writes its line: waiting for the line waits for both.
        wait_for(lines, what="the call's access line")
    finally:
        access.removeHandler(lines)
        access.setLevel(level)
        access.disabled = disabled
    assert refused.code() == grpc.StatusCode.INTERNAL
    [line] = lines()
    labels = {"route": "/test.Service/Answer", "method": "GRPC", "status": "INTERNAL"}
    assert (line["status"], line["request_id"]) == ("INTERNAL", "unserializable")
    assert metrics.registry.get_sample_value("model_server_requests_total", labels) == 1
