"""Work nobody waits for is not computed: a client that leaves before its rows run is dropped.

A live `gunicorn -c gunicorn.conf.py wsgi:app` serves the exact model behind a batch window
far longer than any test: a batch that is not full waits for more rows, so the requests of a
test stay queued until the test itself fills the batch with a request of its own. Then the
batch runs at once, and the metrics say which rows ran: the filler's and nobody else's.
"""

from __future__ import annotations

import http.client
import json
import select
import shutil
import socket
import struct

import grpc
import numpy as np
import psutil
import pytest
import requests
from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc, prediction_service_pb2_grpc

from app.core.call import Call, ModelSpec
from app.core.errors import ClientGone
from app.core.registry import ModelRegistry
from app.core.serving import RequestLayer
from app.http.layers import socket_client_gone
from app.wire import classify
from app.wire.classify import examples_decode
from tests.conftest import Server, integer_rows, wait_for
from tests.nginx_front import Nginx
from tests.test_grpc import predict_request, scores
from tests.test_serving import _exchange, _servable

BATCH_ROWS = 8
MODEL = "default"
PREDICT = "/tensorflow.serving.PredictionService/Predict"


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("client-gone")
    server = Server(folder, {"MODEL_PATH": str(exact_model_path), "MODEL_POLL_SECONDS": "0",
                             "MAX_BATCH_SIZE": str(BATCH_ROWS), "BATCH_TIMEOUT_MS": "120000",
                             "REQUEST_TIMEOUT_MS": "120000", "GRACEFUL_TIMEOUT": "150"})
    server.start()
    yield server
    server.stop()


class Counts:
    """The metrics that say which rows ran and who left, read as changes since the test began."""

    NAMES = {
        "rows_run": ("model_server_batch_size_rows_sum", {"model": MODEL}),
        "predict_calls": ("model_server_batch_size_rows_count", {"model": MODEL}),
        "client_gone": ("model_server_rejections_total", {"model": MODEL, "reason": "client_gone"}),
    }

    def __init__(self, server: Server) -> None:
        self.server = server
        self.start = self.read()

    def read(self) -> dict[str, float]:
        return {key: self.server.metric(name, **labels) for key, (name, labels) in self.NAMES.items()}

    def since(self) -> dict[str, float]:
        now = self.read()
        return {key: now[key] - self.start[key] for key in now}


@pytest.fixture(scope="module")
def nginx(tmp_path_factory, server):
    assert shutil.which("nginx"), "the nginx binary is needed (.ci/run installs Debian's package)"
    front = Nginx(tmp_path_factory.mktemp("nginx"), upstream_port=server.port).start()
    yield front
    front.stop()


def connections_to(port: int) -> dict[int, str]:
    """The state of each TCP connection to the local `port`, by the port of its other end."""
    return {conn.raddr.port: conn.status for conn in psutil.net_connections("tcp4")
            if conn.laddr and conn.laddr.port == port and conn.raddr}


def queued(server: Server, rows: int) -> None:
    wait_for(lambda: server.metric("model_server_queue_rows", model=MODEL) == rows, what=f"{rows} rows queued")


def answered(server: Server, status: str, route: str) -> float:
    return server.metric("model_server_requests_total", route=route, status=status)


def test_grpc_calls_cancelled_while_queued_never_run(server, exact_model):
    counts = Counts(server)
    cancelled_before = answered(server, "CANCELLED", PREDICT)
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        leaving = [stub.Predict.future(predict_request(MODEL, integer_rows(2, seed=1)), timeout=120),
                   stub.Predict.future(predict_request(MODEL, integer_rows(3, seed=2)), timeout=120)]
        queued(server, 5)
        for call in leaving:
            assert call.cancel()
        # A round trip on the same connection, after the cancellations: the server reads the
        # connection in order, so when this is answered it has seen both calls cancelled.
        model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec={"name": MODEL}), timeout=30)
        filler = integer_rows(BATCH_ROWS - 5, seed=3)
        response = stub.Predict(predict_request(MODEL, filler), timeout=120)

    np.testing.assert_array_equal(scores(response), exact_model(filler).numpy())
    # One predict call, which held the filler's rows only; the 5 rows of the calls that left never ran.
    assert counts.since() == {"rows_run": len(filler), "predict_calls": 1, "client_gone": 2}
    # Each cancelled call is answered CANCELLED and counted as such: neither an error nor a traceback.
    wait_for(lambda: answered(server, "CANCELLED", PREDICT) == cancelled_before + 2, what="two calls counted")
    assert server.metric("model_server_queue_rows", model=MODEL) == 0
    assert "Traceback" not in server.log()


def test_http_client_that_closed_its_connection_is_left_out_of_its_batch(server, exact_model):
    counts = Counts(server)
    left_before = answered(server, "499", "/predict")
    leaving = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    leaving.request("POST", "/predict", body=json.dumps({"instances": integer_rows(2, seed=4).tolist()}),
                    headers={"Content-Type": "application/json"})
    queued(server, 2)
    leaving_port = leaving.sock.getsockname()[1]
    leaving.close()  # without reading the answer
    wait_for(lambda: connections_to(server.port).get(leaving_port) == psutil.CONN_CLOSE_WAIT,
             what="Gunicorn's end of the connection half closed")
    filler = integer_rows(BATCH_ROWS - 2, seed=5)

    answer = server.predict(filler)

    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32), exact_model(filler).numpy())
    assert (answer.headers["X-Batch-Size"], answer.headers["X-Batch-Requests"]) == (str(len(filler)), "1")
    assert counts.since() == {"rows_run": len(filler), "predict_calls": 1, "client_gone": 1}
    # Answered 499 (nginx's status for a client that closed first), to nobody: not a 500, no traceback.
    wait_for(lambda: answered(server, "499", "/predict") == left_before + 1, what="the request counted")
    assert server.metric("model_server_queue_rows", model=MODEL) == 0
    assert "Traceback" not in server.log()


# -- the request layer: one predicate, for predict, classify and regress ------------------------


CALLS = {
    "predict": lambda on, client_gone: on.infer(
        Call.within(on.deadline_s(), model=ModelSpec("m"), client_gone=client_gone, exchange=_exchange()),
        lambda _signature, _rows: {"x": np.ones((1, 2), np.float32)}),
    "classify": lambda on, client_gone: classify.classify(
        on, Call.within(on.deadline_s(), model=ModelSpec("m"), signature="classify", client_gone=client_gone,
                        exchange=_exchange()),
        examples_decode(lambda _rows: np.array([b"e"], object))),
    "regress": lambda on, client_gone: classify.regress(
        on, Call.within(on.deadline_s(), model=ModelSpec("m"), signature="regress", client_gone=client_gone,
                        exchange=_exchange()),
        examples_decode(lambda _rows: np.array([b"e"], object))),
}
SIGNATURES = {"predict": "serving_default", "classify": "classify", "regress": "regress"}


@pytest.fixture
def layer_and_registry():
    """The request layer over tests/test_serving.py's model 'm': plain Python signatures, no TensorFlow."""
    registry = ModelRegistry("m")
    registry.add(_servable(1))
    layer = RequestLayer(registry, timeout_s=30, max_request_bytes=1 << 20)
    yield layer, registry
    registry.close(drain=False)


@pytest.mark.parametrize("method", CALLS)
def test_the_layer_drops_a_request_whose_client_has_gone(layer_and_registry, method):
    layer, registry = layer_and_registry
    servable = registry.get("m")
    asked = []

    with pytest.raises(ClientGone, match="the client left before its request ran"):
        CALLS[method](layer, lambda: asked.append(1) or True)

    assert asked == [1]
    assert servable.batchers[SIGNATURES[method]].batches_run == 0


@pytest.mark.parametrize("method", CALLS)
def test_the_layer_serves_a_request_whose_client_waits(layer_and_registry, method):
    layer, registry = layer_and_registry
    asked = []

    CALLS[method](layer, lambda: bool(asked.append(1)))

    assert asked == [1]


# -- the peek that tells whether an HTTP client has gone ---------------------------------------


@pytest.fixture
def connection():
    """A connected TCP pair on loopback: (the server's side, the client's side)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    with served, client:
        yield served, client


def test_a_client_that_waits_is_not_gone(connection):
    served, _client = connection
    assert socket_client_gone(served)() is False


def test_a_pipelined_next_request_is_not_gone_and_stays_unread(connection):
    served, client = connection
    client.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
    assert select.select([served], [], [], 30)[0], "the bytes never arrived"

    assert socket_client_gone(served)() is False
    assert served.recv(64) == b"GET /healthz HTTP/1.1\r\n\r\n"


def test_a_client_that_closed_its_connection_is_gone(connection):
    served, client = connection
    gone = socket_client_gone(served)
    client.close()
    assert gone() is True


def test_a_reset_connection_is_gone(connection):
    served, client = connection
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    client.close()
    assert socket_client_gone(served)() is True


def test_no_socket_gets_no_predicate():
    assert socket_client_gone(None) is None


def test_behind_nginx_a_request_whose_client_left_never_runs(server, nginx, exact_model):
    # nginx (deploy/nginx/nginx.conf) closes its connection to Gunicorn when its own client
    # leaves (proxy_ignore_client_abort is off), so Gunicorn's peek sees the end of that one.
    counts = Counts(server)
    leaving = http.client.HTTPConnection("127.0.0.1", nginx.port, timeout=120)
    leaving.request("POST", "/predict", body=json.dumps({"instances": integer_rows(2, seed=6).tolist()}),
                    headers={"Content-Type": "application/json"})
    queued(server, 2)
    upstream = {port for port, state in connections_to(server.port).items() if state == psutil.CONN_ESTABLISHED}
    leaving.close()
    wait_for(lambda: any(connections_to(server.port).get(port) == psutil.CONN_CLOSE_WAIT for port in upstream),
             what="nginx closing its connection to Gunicorn")
    filler = integer_rows(BATCH_ROWS - 2, seed=7)

    answer = requests.post(nginx.url + "/predict", json={"instances": filler.tolist()}, timeout=120)

    assert answer.status_code == 200, answer.text
    np.testing.assert_array_equal(np.asarray(answer.json()["predictions"], np.float32), exact_model(filler).numpy())
    assert counts.since() == {"rows_run": len(filler), "predict_calls": 1, "client_gone": 1}
