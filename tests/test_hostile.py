"""Hostile and unlucky clients against live Gunicorn servers: bounded bodies, clean errors, nothing leaked.

Raw sockets where a client library would hide what is on the wire (chunked framing, bodies
cut short, a body that stalls); every socket has a timeout, every loop a bound.
"""

from __future__ import annotations

import json
import random
import re
import socket
import string
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import orjson
import pytest
import requests

from app.core.limits import derived_max_request_bytes, max_request_bytes
from app.core.models import STRING, LoadedModel, TensorInfo
from app.ops.settings import Settings
from tests.conftest import FEATURES, Server, integer_rows
from tests.test_reliability import POISON, expected_scores, save_guarded_model

SOCKET_TIMEOUT_S = 30
LARGE_BODY_BYTES = 4096
REQUEST_TIMEOUT_MS = 2000
# MAX_REQUEST_ROWS left at 0: 2 x MAX_BATCH_SIZE (32), under MAX_QUEUE_ROWS (128).
MAX_ROWS = 64
# The README's formula for the exact model, whose one input "features" takes 4 float32 a row:
# rows x (elements x 32 + len(name) + 8) + 64 KiB = 74,752 bytes.
DERIVED_LIMIT = MAX_ROWS * (FEATURES * 32 + len("features") + 8) + 64 * 1024


@pytest.fixture(scope="module")
def guarded_model_path(tmp_path_factory) -> Path:
    # A model whose signature raises on an input at or above POISON.
    return save_guarded_model(tmp_path_factory.mktemp("guarded") / "model")


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path, guarded_model_path):
    """The exact model (the default), and beside it the guarded model as "guarded". Both take
    one input "features" of 4 float32 a row, so the derived body limit is the exact model's."""
    folder = tmp_path_factory.mktemp("hostile")
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [{"name": "default", "path": str(exact_model_path)},
                                             {"name": "guarded", "path": str(guarded_model_path)}]}))
    running = Server(folder, {
        "MODEL_CONFIG": str(config),
        "READYZ_DETAIL": "false",
        "LARGE_BODY_BYTES": str(LARGE_BODY_BYTES),
        "LARGE_BODY_SLOTS": "1",
        "REQUEST_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
    }).start()
    yield running
    running.stop()


def padded_body(rows: np.ndarray, size: int) -> bytes:
    """A valid predict body of exactly `size` bytes: JSON allows any amount of trailing space."""
    body = orjson.dumps({"instances": rows.tolist()})
    assert len(body) <= size
    return body + b" " * (size - len(body))


def exchange(server: Server, raw: bytes, *, shut_write: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes on a fresh connection; read one response (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(raw)
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        part = sock.recv(65536)
        assert part, f"connection closed before a response; got {data!r}"
        data += part
    head, body = data.split(b"\r\n\r\n", 1)
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in header_lines)}
    length = int(headers["content-length"])
    while len(body) < length:
        part = sock.recv(65536)
        assert part, "connection closed inside the response body"
        body += part
    return int(status_line.split()[1]), headers, body[:length]


def request_head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(body: bytes, size: int = 8192) -> bytes:
    pieces = [body[i:i + size] for i in range(0, len(body), size)]
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def readyz(server: Server) -> dict:
    return requests.get(server.url + "/readyz", timeout=10).json()


# -- item 1: the derived limit and the large-body slots ----------------------------------

def test_derived_max_request_bytes_is_exact(server, exact_model):
    rows = integer_rows(3, seed=11)
    at_limit = requests.post(server.url + "/predict", data=padded_body(rows, DERIVED_LIMIT), timeout=30,
                             headers={"Content-Type": "application/json"})
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json()["predictions"] == exact_model(rows).numpy().tolist()
    over = requests.post(server.url + "/predict", data=padded_body(rows, DERIVED_LIMIT + 1), timeout=30,
                         headers={"Content-Type": "application/json"})
    assert over.status_code == 413
    assert over.json() == {"error": f"the request body is larger than {DERIVED_LIMIT} bytes (MAX_REQUEST_BYTES)"}


def signature_model(*inputs: TensorInfo) -> LoadedModel:
    return LoadedModel(name="m", version=1, source="", inputs=list(inputs), outputs=[], predict=lambda batch: {})


def test_derived_limit_sums_the_inputs_and_falls_back_where_a_signature_has_no_bound():
    image = TensorInfo("image", (8, 8, 3), np.dtype("float32"), "DT_FLOAT")
    ids = TensorInfo("ids", (5,), np.dtype("int64"), "DT_INT64")
    assert derived_max_request_bytes(signature_model(image, ids), 10) == (
        10 * (8 * 8 * 3 * 32 + len("image") + 8 + 5 * 32 + len("ids") + 8) + 64 * 1024)
    text = TensorInfo("text", (), STRING, "DT_STRING")
    free = TensorInfo("tokens", (None,), np.dtype("int32"), "DT_INT32")
    assert derived_max_request_bytes(signature_model(ids, text), 10) == 16 * 1024 * 1024
    assert derived_max_request_bytes(signature_model(free), 10) == 16 * 1024 * 1024


def test_derived_limit_covers_every_signature_of_every_version():
    """A :classify signature takes serialized examples (strings): its bodies have no bound."""
    ids = TensorInfo("ids", (5,), np.dtype("int64"), "DT_INT64")
    examples = TensorInfo("examples", (), STRING, "DT_STRING")

    def servable(version, **signatures):
        model = SimpleNamespace(signatures={key: signature_model(*inputs) for key, inputs in signatures.items()})
        return SimpleNamespace(model=model, batchers={key: SimpleNamespace(info=SimpleNamespace(max_request_rows=10))
                                                    for key in signatures})

    registry = SimpleNamespace(servables=lambda: [servable(1, serving_default=[ids]),
                                                  servable(2, serving_default=[ids], classify=[examples])])
    assert max_request_bytes(Settings(), registry) == 16 * 1024 * 1024
    registry = SimpleNamespace(servables=lambda: [servable(1, serving_default=[ids])])
    assert max_request_bytes(Settings(), registry) == 10 * (5 * 32 + len("ids") + 8) + 64 * 1024
    assert max_request_bytes(Settings(max_request_bytes=1000), registry) == 1000


def test_large_body_waits_for_a_slot_then_gets_503(server, exact_model):
    rows = integer_rows(2, seed=12)
    body = padded_body(rows, LARGE_BODY_BYTES * 2)
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as holder:
        # The only slot is taken by a body that stalls after its first bytes.
        holder.sendall(request_head("/predict", {"Content-Length": str(len(body))}) + body[:100])
        deadline = time.monotonic() + 30
        while readyz(server)["large_bodies_in_flight"] != 1:
            assert time.monotonic() < deadline, "the stalled body never took its slot"
        # The largest body allowed: more than Gunicorn drains by itself after an answer.
        largest = padded_body(rows, DERIVED_LIMIT)
        with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
            started = time.monotonic()
            sock.sendall(request_head("/predict", {"Content-Length": str(len(largest))}) + largest)
            status, headers, refused = read_response(sock)
            waited = time.monotonic() - started
            assert status == 503
            assert headers["retry-after"] == "1"
            assert json.loads(refused) == {"error": "too many large request bodies are being handled; retry later"}
            assert waited >= REQUEST_TIMEOUT_MS / 1000  # it waited for the slot until its deadline
            # Small bodies never wait for a slot; the refused body was read to its end, so
            # the same connection carries the next request.
            sock.sendall(predict_request(rows))
            status, _, small = read_response(sock)
            assert status == 200
            assert json.loads(small)["predictions"] == exact_model(rows).numpy().tolist()
        holder.sendall(body[100:])
        status, _, answer = read_response(holder)
    assert status == 200
    assert json.loads(answer)["predictions"] == exact_model(rows).numpy().tolist()
    assert readyz(server)["large_bodies_in_flight"] == 0
    again = requests.post(server.url + "/predict", data=body, timeout=30, headers={"Content-Type": "application/json"})
    assert again.status_code == 200


def test_chunked_body_takes_a_slot_once_it_grows_past_large_body_bytes(server, exact_model):
    rows = integer_rows(2, seed=17)
    framed = chunked(padded_body(rows, LARGE_BODY_BYTES * 3), size=LARGE_BODY_BYTES + 10)
    first_chunk_end = framed.index(b"\r\n", framed.index(b"\r\n") + 2) + 2
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(request_head("/predict", {"Transfer-Encoding": "chunked"}) + framed[:first_chunk_end])
        deadline = time.monotonic() + 30
        while readyz(server)["large_bodies_in_flight"] != 1:
            assert time.monotonic() < deadline, "the chunked body never took a slot"
        sock.sendall(framed[first_chunk_end:])
        status, _, body = read_response(sock)
    assert status == 200
    assert json.loads(body)["predictions"] == exact_model(rows).numpy().tolist()
    assert readyz(server)["large_bodies_in_flight"] == 0


# -- item 3: over-limit bodies, framing errors -------------------------------------------

def predict_request(rows: np.ndarray) -> bytes:
    body = orjson.dumps({"instances": rows.tolist()})
    return request_head("/predict", {"Content-Length": str(len(body))}) + body


def test_over_limit_body_gets_a_readable_413(server):
    # 8 MiB: far more than loopback's socket buffers and Gunicorn's own 64 KiB drain, so
    # without the discard the client is still writing when the connection closes.
    oversized = b'{"instances": [' + b"1, " * (8 * 1024 * 1024 // 3) + b"1]}"
    answer = requests.post(server.url + "/predict", data=oversized, timeout=60,
                           headers={"Content-Type": "application/json"})
    assert answer.status_code == 413
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.json() == {"error": f"the request body is larger than {DERIVED_LIMIT} bytes (MAX_REQUEST_BYTES)"}
    assert answer.headers["X-Request-ID"]


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_over_limit_body_gets_413_and_the_connection_serves_the_next_request(server, exact_model, framing):
    oversized = padded_body(integer_rows(3, seed=14), DERIVED_LIMIT * 4)
    if framing == "chunked":
        first = request_head("/predict", {"Transfer-Encoding": "chunked"}) + chunked(oversized)
    else:
        first = request_head("/predict", {"Content-Length": str(len(oversized))}) + oversized
    rows = integer_rows(2, seed=13)
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(first)
        status, headers, body = read_response(sock)
        assert status == 413
        assert headers["content-type"] == "application/json"
        assert json.loads(body) == {
            "error": f"the request body is larger than {DERIVED_LIMIT} bytes (MAX_REQUEST_BYTES)"}
        # The body was read to its end: the same connection carries the next request.
        sock.sendall(predict_request(rows))
        status, _, body = read_response(sock)
    assert status == 200
    assert json.loads(body)["predictions"] == exact_model(rows).numpy().tolist()


@pytest.mark.parametrize("size", [100, LARGE_BODY_BYTES * 2, DERIVED_LIMIT])
def test_chunked_body_within_the_limit_is_served(server, exact_model, size):
    rows = integer_rows(3, seed=15)
    status, _, body = exchange(server, request_head("/predict", {"Transfer-Encoding": "chunked"})
                               + chunked(padded_body(rows, max(size, 100)), size=1000))
    assert status == 200
    assert json.loads(body)["predictions"] == exact_model(rows).numpy().tolist()


FRAMING_ERRORS = [
    # (id, headers, bytes after the head, whether the client half-closes, words of the error)
    ("invalid chunk size", {"Transfer-Encoding": "chunked"}, b"zz\r\n{}\r\n0\r\n\r\n", False, "invalid chunk size"),
    ("chunk without CRLF", {"Transfer-Encoding": "chunked"}, b"2\r\n{}XX0\r\n\r\n", False, "not followed by CRLF"),
    # Cut short, then the client stops sending: Gunicorn sees the end of the stream, and the
    # half-closed connection can still carry the answer back.
    ("chunked body cut short", {"Transfer-Encoding": "chunked"}, b"20\r\n{\"instances\"", True,
     "connection ended before the body did"),
    ("body shorter than its length", {"Content-Length": "100"}, b'{"instances": [[1, 2', True,
     "ended after 20 of the 100 bytes"),
    ("large body shorter than its length", {"Content-Length": str(LARGE_BODY_BYTES * 2)}, b'{"instances": [[1, 2',
     True, f"ended after 20 of the {LARGE_BODY_BYTES * 2} bytes"),
]


@pytest.mark.parametrize("headers, rest, shut_write, words", [case[1:] for case in FRAMING_ERRORS],
                         ids=[case[0] for case in FRAMING_ERRORS])
def test_framing_errors_answer_400_json(server, headers, rest, shut_write, words):
    status, answer_headers, body = exchange(server, request_head("/predict", headers) + rest, shut_write=shut_write)
    assert status == 400
    assert answer_headers["content-type"] == "application/json"
    assert words in json.loads(body)["error"]
    assert readyz(server)["large_bodies_in_flight"] == 0  # a refused body gives its slot back


# -- item 3: nothing leaked --------------------------------------------------------------

def test_model_error_answers_class_and_first_line_and_logs_the_rest(server):
    guarded_server, path = server, "/v1/models/guarded:predict"
    rows = integer_rows(1, seed=16)
    rows[0, 1] = POISON
    answer = requests.post(guarded_server.url + path, json={"instances": rows.tolist()}, timeout=30,
                           headers={"X-Request-ID": "poisoned-request-42"})
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error.startswith("model raised InvalidArgumentError: ")
    assert "poison" in error
    assert "\n" not in error and "File " not in error and "[[{{node" not in error
    # The full text is in the log, on a line that names the request id.
    deadline = time.monotonic() + 30
    while "predict failed, request_id=poisoned-request-42: InvalidArgumentError" not in guarded_server.log():
        assert time.monotonic() < deadline, guarded_server.log()[-3000:]
    logged = guarded_server.log().split("predict failed, request_id=poisoned-request-42: ", 1)[1]
    assert len(logged.splitlines()) > 1 and logged.startswith("InvalidArgumentError: ")
    good = requests.post(guarded_server.url + path, json={"instances": integer_rows(2).tolist()}, timeout=30)
    assert good.json()["predictions"] == expected_scores(integer_rows(2)).tolist()


def request_series(server: Server) -> dict[tuple[str, str], float]:
    """model_server_requests_total by (method, route), summed over statuses."""
    text = requests.get(server.url + "/metrics", timeout=10).text
    series: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("model_server_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            key = (labels["method"], labels["route"])
            series[key] = series.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return series


def test_random_methods_and_paths_add_no_label_values(server):
    before = request_series(server)
    generator = random.Random(3)
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        for index in range(300):
            # The first one claims gRPC's label over HTTP.
            method = "".join(generator.choices(string.ascii_uppercase, k=8)) if index else "GRPC"
            path = "/" + "".join(generator.choices(string.ascii_lowercase, k=10)) if index % 2 else "/predict"
            sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
            status, _, _ = read_response(sock)
            assert status in (404, 405)
    after = request_series(server)
    grown = {key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key, 0.0)}
    # A 405 matched no rule either: every one is (other, other). /metrics' own GET counts once more.
    assert grown == {("other", "other"): 300, ("GET", "/metrics"): 1}
    assert set(after) - set(before) <= {("other", "other"), ("GET", "/metrics")}


def test_readyz_shows_no_paths_or_pid_unless_asked(server, exact_model_path, guarded_model_path, in_process_app):
    plain = requests.get(server.url + "/readyz", timeout=10)
    assert plain.status_code == 200
    assert "pid" not in plain.json()
    assert "source" not in plain.json()["models"]["default"]
    assert "source" not in plain.json()["models"]["guarded"]
    for path in (exact_model_path, guarded_model_path):
        assert str(path) not in plain.text and str(path.parent) not in plain.text
    # Asked for: in-process, as what /readyz shows is the app's alone, not Gunicorn's.
    detailed = in_process_app(model_path=str(guarded_model_path), readyz_detail=True).test_client().get("/readyz").json
    assert isinstance(detailed["pid"], int)
    assert detailed["models"]["default"]["source"].endswith("model")
