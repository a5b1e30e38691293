"""Forged log lines and unencodable text against live Gunicorn servers: one request, one log line.

Raw sockets, so the request line reaches the server as an attacker writes it. Each HTTP attack
runs inside tests/http_ledger.py's `siege`: the worker's pid is unchanged, `/healthz` and a
normal predict answer, its memory stays within a bound, and each request has exactly one
access line and one count, with the status its client got.
"""

from __future__ import annotations

import collections
import json
import logging
import re
import socket
import urllib.parse

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
import requests

from app.ops import logs
from tests.conftest import Server, wait_for
from tests.grpc_ledger import Ledger
from tests.http_ledger import siege

SOCKET_TIMEOUT_S = 30
FORGED = ("2026-11-25T00:00:00.000+00:00 INFO [1] app.access: access method=GET path=/admin status=200 "
          "request_id=forged")


@pytest.fixture(scope="module")
def text_server(tmp_path_factory, exact_model_path):
    server = Server(tmp_path_factory.mktemp("hostile-logs"), {
        "MODEL_PATH": str(exact_model_path), "LOG_FORMAT": "text", "READYZ_DETAIL": "false"})
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def json_server(tmp_path_factory, exact_model_path):
    server = Server(tmp_path_factory.mktemp("hostile-logs-json"), {
        "MODEL_PATH": str(exact_model_path), "LOG_FORMAT": "json", "READYZ_DETAIL": "false"})
    yield server.start()
    server.stop()


def raw_request(server: Server, head: bytes, body: bytes = b"") -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(head + body)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            part = sock.recv(65536)
            if not part:
                return answer
            answer += part


def lines_with(server: Server, text: str) -> list[str]:
    return [line for line in server.log().splitlines() if text in line]


INJECTIONS = ["%0d%0a", "%0a", "%c2%85", "%e2%80%a8", "%0b%0c", "%1b%5b2K%0d"]


def forged_path(injected: str) -> str:
    return f"/x{injected}{requests.utils.quote(FORGED)}%1b[2K"


def forge(server: Server, injected: str, request_id: str) -> None:
    answer = raw_request(server, f"GET {forged_path(injected)} HTTP/1.1\r\nHost: x\r\nX-Request-ID: {request_id}\r\n"
                                 "Connection: close\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 404 ")


@pytest.mark.parametrize("injected", INJECTIONS)
def test_a_path_cannot_write_a_second_log_line(text_server, exact_model, injected):
    request_id = f"forge-{abs(hash(injected))}"
    with siege(text_server, exact_model) as watch:
        forge(text_server, injected, request_id)
        watch.got("GET", 404)
        watch.serving()
    [line] = wait_for(lambda: lines_with(text_server, request_id), what="the access line")
    log = text_server.log()
    assert "\x1b" not in log and "\x85" not in log and "\u2028" not in log and "\r" not in log
    # The forged text is inside the one line's quoted path, not a line of its own.
    assert not any(other.startswith("2026-11-25T00:00:00.000") for other in log.splitlines())
    assert re.match(r'\S+ INFO \[\d+\] app\.access: access method=GET path="/x\\', line), line
    assert line.endswith(f"request_id={request_id}")


@pytest.mark.parametrize("injected", INJECTIONS)
def test_a_path_is_one_json_log_line_holding_it_whole(json_server, exact_model, injected):
    request_id = f"forge-json-{abs(hash(injected))}"
    with siege(json_server, exact_model) as watch:
        forge(json_server, injected, request_id)
        watch.got("GET", 404)
        watch.serving()
    [line] = lines_with(json_server, f'"request_id":"{request_id}"')
    assert json.loads(line)["path"] == urllib.parse.unquote(forged_path(injected), errors="replace")
    log = json_server.log()
    assert "\x1b" not in log and "\x85" not in log and "\u2028" not in log and "\r" not in log


def test_a_request_id_with_a_final_newline_is_replaced(text_server):
    answer = requests.get(text_server.url + "/healthz", timeout=10, headers={"X-Request-ID": "abc"})
    assert answer.headers["X-Request-ID"] == "abc"
    assert logs.accept_request_id("id\n") != "id\n"
    assert logs.accept_request_id("id") == "id"


def test_a_grpc_request_id_with_a_final_newline_gets_the_logged_status_and_a_new_id(text_server):
    ledger = Ledger(text_server)
    host, port = text_server.grpc_target.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_S)
    # h2 would refuse to send a newline in a header value; an attacker's client does not.
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                                                normalize_outbound_headers=False))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "POST"), (":scheme", "http"),
                          (":path", "/tensorflow.serving.ModelService/GetModelStatus"),
                          (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers"),
                          ("x-request-id", "id\n")])
    conn.send_data(1, b"\x00\x00\x00\x00\x00", end_stream=True)  # an empty message: no model_spec
    sock.sendall(conn.data_to_send())
    headers: dict[str, str] = {}
    sock.settimeout(10)
    try:
        while "grpc-status" not in headers:
            data = sock.recv(65536)
            assert data, f"closed before an answer; headers {headers}"
            for event in conn.receive_data(data):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers.update((k.decode(), v.decode()) for k, v in event.headers)
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    # Before: grpc-core refused the echoed "id\n" and the client got INTERNAL while the log said
    # INVALID_ARGUMENT. Now the id is replaced, and the client gets what the log says.
    assert headers["grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])
    assert headers["grpc-message"] == "Missing ModelSpec"
    new_id = headers["x-request-id"]
    assert new_id != "id\n" and len(new_id) == 32
    ledger.settle(collections.Counter({("/tensorflow.serving.ModelService/GetModelStatus", "INVALID_ARGUMENT"): 1}))
    [line] = ledger.lines()
    assert (line["request_id"], line["status"]) == (new_id, "INVALID_ARGUMENT")


def test_lone_surrogate_is_400_and_one_json_log_line(json_server, exact_model):
    body = b'{"signature_name": "\\ud800", "instances": [[1, 2, 3, NaN]]}'
    with siege(json_server, exact_model) as watch:
        answer = requests.post(json_server.url + "/predict", data=body, timeout=30,
                               headers={"Content-Type": "application/json", "X-Request-ID": "surrogate-1"})
        watch.got("POST", answer.status_code)
        watch.serving()
    assert answer.status_code == 400
    assert answer.json() == {"error": "malformed JSON: the request body holds a lone surrogate (\\ud800): "
                                      "a string is not valid Unicode"}
    line = wait_for(lambda: lines_with(json_server, '"request_id":"surrogate-1"'), what="the access line")
    assert json.loads(line[0])["status"] == 400
    assert "Logging error" not in json_server.log()


@pytest.mark.parametrize("route", ["/v1/models/default:predict", "/v1/models/default:classify",
                                   "/v1/models/default:regress"])
def test_lone_surrogate_is_400_on_every_route(json_server, exact_model, route):
    body = (b'{"signature_name": "\\udc00", "instances": [[1, 2, 3, NaN]], '
            b'"examples": [{"x": "\\ud800"}], "context": {"y": Infinity}}')
    with siege(json_server, exact_model) as watch:
        answer = requests.post(json_server.url + route, data=body, timeout=30,
                               headers={"Content-Type": "application/json"})
        watch.got("POST", answer.status_code)
        watch.serving()
    assert answer.status_code == 400
    assert "lone surrogate" in answer.json()["error"]
    assert "Logging error" not in json_server.log()


def test_the_json_formatter_never_fails():
    record = logging.makeLogRecord({"msg": "bad \ud800 text", "name": "app", "levelno": logging.ERROR,
                                    "levelname": "ERROR", "fields": {"path": "/\udfff", "other": object()}})
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "bad \\ud800 text" and entry["path"] == "/\\udfff"
    assert entry["other"].startswith("<object object at ")


def test_the_json_formatter_escapes_what_a_reader_could_take_for_a_line_break_or_a_control():
    record = logging.makeLogRecord({"msg": "access", "name": "app.access", "levelno": logging.INFO,
                                    "levelname": "INFO", "fields": {"path": "/a\x85b\u2028c\u2029d\x9b2K\x7f"}})
    line = logs.JsonFormatter().format(record)
    assert line.isascii() and len(line.splitlines()) == 1
    assert line.endswith('"path":"/a\\u0085b\\u2028c\\u2029d\\u009b2K\\u007f"}')
    assert json.loads(line)["path"] == "/a\x85b\u2028c\u2029d\x9b2K\x7f"


def test_the_text_formatter_escapes_every_field():
    record = logging.makeLogRecord({"msg": "access", "name": "app.access", "levelno": logging.INFO,
                                    "levelname": "INFO",
                                    "fields": {"path": "/a\r\nb\x1b[2K\x85\u2028\ud800 c=d\"\\", "status": 200}})
    line = logs.TextFormatter().format(record)
    assert line.isascii() and "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(' path="/a\\x0d\\x0ab\\x1b[2K\\x85\\u2028\\ud800 c=d\\"\\\\" status=200')


# -- reflected strings ------------------------------------------------------------------------

LONG_NAME = "s" * 60_000


def test_a_long_signature_name_is_not_echoed_whole_over_rest(json_server, exact_model):
    body = {"signature_name": LONG_NAME, "instances": [[1, 2, 3, 4]]}
    with siege(json_server, exact_model) as watch:
        answer = requests.post(json_server.url + "/v1/models/default:predict", json=body, timeout=30)
        watch.got("POST", answer.status_code)
        watch.serving()
    assert answer.status_code == 400
    full = (f'Serving signature name: "{LONG_NAME}" not found in signature def (unknown signature_name; '
            "model 'default' v1 has ['serving_default'])")
    assert answer.json() == {"error": full[:1000] + f"... ({len(full) - 1000} more characters)"}


def test_a_long_signature_name_gives_a_grpc_status_the_client_can_read(text_server):
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "default"
    request.model_spec.signature_name = "s" * 70_000
    request.inputs["features"].CopyFrom(tf.make_tensor_proto([[1.0, 2.0, 3.0, 4.0]]))
    with grpc.insecure_channel(text_server.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=30)
    # Before: the 70 KB status passed the client's metadata limit, and it saw RESOURCE_EXHAUSTED instead.
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    full = f'Serving signature key "{request.model_spec.signature_name}" not found.'
    assert raised.value.details() == full[:1000] + f"... ({len(full) - 1000} more characters)"


# -- URLs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", ["%EF%BC%91", "%D9%A1", "%E0%A5%A7"])  # fullwidth, Arabic-Indic, Devanagari 1
def test_versions_are_ascii_digits_only(json_server, exact_model, version):
    with siege(json_server, exact_model) as watch:
        answer = requests.get(f"{json_server.url}/v1/models/default/versions/{version}", timeout=10)
        watch.got("GET", answer.status_code)
        watch.serving()
        assert requests.get(f"{json_server.url}/v1/models/default/versions/1", timeout=10).status_code == 200
        watch.got("GET", 200)
    assert answer.status_code == 400
    assert answer.json() == {"error": f"Malformed request: GET /v1/models/default/versions/{version}"}


def test_a_double_slash_is_not_redirected_by_host(json_server, exact_model):
    with siege(json_server, exact_model) as watch:
        answer = requests.get(f"{json_server.url}/v1//models/default", timeout=10, allow_redirects=False,
                              headers={"Host": "attacker.example"})
        watch.got("GET", answer.status_code)
        watch.serving()
    assert answer.status_code == 400
    assert "Location" not in answer.headers
    assert answer.json() == {"error": "Malformed request: GET /v1//models/default"}
