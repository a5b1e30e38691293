"""Every bad request gets its status and a JSON body saying what is wrong, from a live server."""

from __future__ import annotations

import pytest
import requests

from tests.conftest import Server

JSON = {"Content-Type": "application/json"}
MAX_REQUEST_BYTES = 4096
MAX_QUEUE_ROWS = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory, exact_model_path):
    running = Server(tmp_path_factory.mktemp("errors"), {
        "MODEL_PATH": str(exact_model_path),
        "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES),
        "MAX_QUEUE_ROWS": str(MAX_QUEUE_ROWS),
    }).start()
    yield running
    running.stop()


ROW = [1, 2, 3, 4]

BAD_BODIES = [
    # (id, body bytes, status, words the error must contain)
    ("malformed json", b'{"instances": [[1, 2', 400, "malformed JSON"),
    ("empty body", b"", 400, "body is empty"),
    ("invalid utf-8", b'{"instances": [[1, 2, 3, "\xff"]]}', 400, "malformed JSON"),
    ("not an object", b"[[1, 2, 3, 4]]", 400, "must be a JSON object"),
    ("neither key", b'{"rows": [[1, 2, 3, 4]]}', 400, "needs 'instances'"),
    ("both keys", b'{"instances": [[1, 2, 3, 4]], "inputs": [[1, 2, 3, 4]]}', 400, "not both"),
    ("instances not a list", b'{"instances": 5}', 400, "must be a list"),
    ("no rows", b'{"instances": []}', 400, "is empty"),
    ("wrong row shape", b'{"instances": [[1, 2, 3]]}', 400, "must have shape [4]; got rows of shape [3]"),
    ("too deep", b'{"instances": [[[1, 2, 3, 4]]]}', 400, "got rows of shape [1, 4]"),
    ("scalar rows", b'{"instances": [1, 2, 3, 4]}', 400, "got rows of shape []"),
    ("ragged rows", b'{"instances": [[1, 2, 3, 4], [1, 2]]}', 400, "row 1 has shape [2]"),
    ("string value", b'{"instances": [[1, 2, "x", 4]]}', 400, 'instances[0]: a string "x"'),
    ("null value", b'{"instances": [[1, 2, 3, 4], [1, null, 3, 4]]}', 400, "instances[1]: null"),
    ("boolean value", b'{"instances": [[true, 2, 3, 4]]}', 400, "true/false where input 'features' takes numbers"),
    ("object value", b'{"instances": [[{"a": 1}, 2, 3, 4]]}', 400, "instances[0]: an object"),
    ("too large for float32", b'{"instances": [[1e39, 2, 3, 4]]}', 400, "too large for DT_FLOAT"),
    ("unknown input name", b'{"instances": [{"pixels": [1, 2, 3, 4]}]}', 400, "unknown input(s) ['pixels']"),
    ("columnar not a list", b'{"inputs": "abc"}', 400, "'inputs' must be a list"),
    ("columnar wrong name", b'{"inputs": {"pixels": [[1, 2, 3, 4]]}}', 400, "missing input(s) ['features']"),
    ("unknown signature", b'{"signature_name": "train", "instances": [[1, 2, 3, 4]]}', 400, "unknown signature_name"),
    ("more rows than the queue", b'{"instances": [' + b",".join([b"[1, 2, 3, 4]"] * (MAX_QUEUE_ROWS + 1)) + b"]}",
     413, f"at most {MAX_QUEUE_ROWS} rows"),
    ("body over the limit", b'{"instances": [[' + b"1, " * MAX_REQUEST_BYTES + b'1]]}', 413,
     f"larger than {MAX_REQUEST_BYTES} bytes"),
]


@pytest.mark.parametrize("body,status,words", [case[1:] for case in BAD_BODIES], ids=[case[0] for case in BAD_BODIES])
def test_bad_body_gets_its_status_and_a_clear_json_error(server, body, status, words):
    answer = requests.post(server.url + "/predict", data=body, headers=JSON, timeout=30)
    assert answer.status_code == status
    assert answer.headers["Content-Type"] == "application/json"
    assert words in answer.json()["error"]


@pytest.mark.parametrize(
    "method,path,headers,status,words",
    [
        ("GET", "/nope", {}, 404, "not found"),
        ("GET", "/predict", {}, 405, "not allowed"),
        ("POST", "/v1/models/nope:predict", JSON, 404, "no model named 'nope'"),
        ("POST", "/v1/models/default/versions/9:predict", JSON, 404, "has no version 9"),
        ("POST", "/v1/models/..%2F..%2Fetc:predict", JSON, 404, "not found"),
        ("GET", "/v1/models/nope/metadata", {}, 404, "no model named 'nope'"),
    ],
)
def test_wrong_route_or_method_gets_a_json_error(server, method, path, headers, status, words):
    answer = requests.request(method, server.url + path, data=b'{"instances": [[1, 2, 3, 4]]}', headers=headers,
                              timeout=30)
    assert answer.status_code == status
    assert answer.headers["Content-Type"] == "application/json"
    assert words in answer.json()["error"]


def test_wrong_method_names_the_allowed_ones(server):
    answer = requests.get(server.url + "/predict", timeout=30)
    assert set(answer.headers["Allow"].split(", ")) == {"OPTIONS", "POST"}


def test_server_still_answers_after_every_bad_request(server, exact_model):
    import numpy as np

    answer = requests.post(server.url + "/predict", json={"instances": [ROW]}, timeout=30)
    assert answer.status_code == 200
    assert answer.json()["predictions"] == exact_model(np.array([ROW], np.float32)).numpy().tolist()
