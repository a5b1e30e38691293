"""TensorFlow Serving's own REST examples, replayed verbatim against a live server.

The curl lines are copied from tensorflow/serving's documentation (README.md "Serve a
Tensorflow model in 60 seconds" and g3doc/api_rest.md); only host:port changes. curl -d
sends a form Content-Type and TF Serving never looks at it, so neither may we. The models
are built here as TF2 SavedModels shaped like TF Serving's test models (x and y are
[-1, 1] in its half_plus_two, testdata/saved_model_half_plus_two.py); every expected
value is exact in float32.
"""

from __future__ import annotations

import base64
import json

import pytest
import requests

from tests.conftest import Server

TIMEOUT_S = 60
MAX_REQUEST_ROWS = 4


def save(module, path, signature) -> None:
    import tensorflow as tf

    tf.saved_model.save(module, str(path), signatures={"serving_default": signature})


def build_models(root) -> dict:
    import tensorflow as tf

    class HalfPlus(tf.Module):
        def __init__(self, c: float):
            super().__init__()
            self.c = c

        @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + self.c}

    class Text(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def serve(self, text):
            upper = tf.strings.upper(text)
            return {"upper": upper, "upper_bytes": upper}

    class Pairs(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 1, 2], tf.float32, name="x")])
        def serve(self, x):
            return {"total": tf.reduce_sum(x, axis=[1, 2])}

    class Uneven(tf.Module):
        """Its 'first' output is not batched: one row whatever the batch."""

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 2.0 * x, "first": x[:1]}

    two, three = HalfPlus(2.0), HalfPlus(3.0)
    save(two, root / "half_plus_two" / "1", two.serve)
    save(three, root / "half_plus_three" / "123", three.serve)
    for name, module in (("text", Text()), ("pairs", Pairs()), ("uneven", Uneven())):
        save(module, root / name, module.serve)
    names = ["half_plus_two", "half_plus_three", "text", "pairs", "uneven"]
    return {"models": [{"name": name, "path": str(root / name)} for name in names]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    (root / "models.json").write_text(json.dumps(build_models(root)))
    running = Server(tmp_path_factory.mktemp("fidelity-logs"), {
        "MODEL_CONFIG": str(root / "models.json"),
        "MAX_REQUEST_ROWS": str(MAX_REQUEST_ROWS),
        "MODEL_POLL_SECONDS": "0",
    }).start()
    yield running
    running.stop()




def post(server, path: str, data, **kwargs) -> requests.Response:
    return requests.post(server.url + path, data=data, timeout=TIMEOUT_S, **kwargs)


def test_readme_half_plus_two_curl_line_answers_as_documented(server):
    """tensorflow/serving README.md (Serve a Tensorflow model in 60 seconds), also g3doc/docker.md;
    the documented line's backslash-newline joined."""
    out = server.curl("curl -d '{\"instances\": [1.0, 2.0, 5.0]}' "
                       "-X POST http://localhost:8501/v1/models/half_plus_two:predict")
    assert json.loads(out) == {"predictions": [2.5, 3.0, 4.5]}


def test_api_rest_guide_curl_lines_answer_as_documented(server):
    """g3doc/api_rest.md, section Example: status, predict, and the 404 for an unknown model."""
    status = server.curl("curl http://localhost:8501/v1/models/half_plus_three")
    assert json.loads(status) == {"model_version_status": [
        {"version": "123", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}
    predict = server.curl("curl -d '{\"instances\": [1.0,2.0,5.0]}' -X POST "
                           "http://localhost:8501/v1/models/half_plus_three:predict")
    assert json.loads(predict) == {"predictions": [3.5, 4.0, 5.5]}
    missing = server.curl("curl -i -d '{\"instances\": [1.0,5.0]}' -X POST "
                           "http://localhost:8501/v1/models/half:predict")
    head, _, body = missing.partition("\n\n")  # text mode reads CRLF as LF
    assert head.startswith("HTTP/1.1 404")
    assert "content-type: application/json" in head.lower()
    assert "half" in json.loads(body)["error"]


@pytest.mark.parametrize("headers", [{}, {"Content-Type": "text/plain"},
                                     {"Content-Type": "application/x-www-form-urlencoded"},
                                     {"Content-Type": "application/json; charset=utf-8"}],
                         ids=["none", "text", "form", "json"])
def test_body_is_json_whatever_its_content_type(server, headers):
    """http_rest_api_handler.cc hands the body to FillPredictRequestFromJson without a look at
    Content-Type; clients send requests.post(url, data=json.dumps(body)) as its docs' readers do."""
    answer = post(server, "/v1/models/half_plus_two:predict", json.dumps({"instances": [1.0, 2.0, 5.0]}),
                  headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [2.5, 3.0, 4.5]}
    bad = post(server, "/v1/models/half_plus_two:predict", b'{"instances": [1.0,', headers=headers)
    assert bad.status_code == 400
    assert "malformed JSON" in bad.json()["error"]


def test_documented_request_shapes_from_the_api_rest_guide(server):
    """g3doc/api_rest.md 'Specifying input tensors in row format': three scalar strings, two [1, 2]
    tensors; and rows of [1] or the columnar format for half_plus_two's [-1, 1] input."""
    strings = post(server, "/v1/models/text:predict", '{"instances": [ "foo", "bar", "baz" ]}')
    assert strings.status_code == 200, strings.text
    assert [row["upper"] for row in strings.json()["predictions"]] == ["FOO", "BAR", "BAZ"]
    pairs = post(server, "/v1/models/pairs:predict", '{"instances": [ [[1, 2]], [[3, 4]] ]}')
    assert pairs.json() == {"predictions": [3.0, 7.0]}
    rows = post(server, "/v1/models/half_plus_two:predict", '{"instances": [[1.0], [2.0]]}')
    assert rows.json() == {"predictions": [[2.5], [3.0]]}
    columns = post(server, "/v1/models/half_plus_two:predict", '{"inputs": [1.0, 2.0, 5.0]}')
    assert columns.json() == {"outputs": [2.5, 3.0, 4.5]}


def test_nan_and_infinity_round_trip(server):
    """g3doc/api_rest.md 'JSON conformance'; util/json_tensor.cc reads them (kParseNanAndInfFlag)
    and writes them (WriteDecimal) as NaN, Infinity and -Infinity."""
    answer = post(server, "/v1/models/half_plus_two:predict", '{"instances": [NaN, Infinity, -Infinity, 2.0]}')
    assert answer.status_code == 200, answer.text
    assert answer.content == b'{"predictions":[NaN,Infinity,-Infinity,3.0]}'
    columns = post(server, "/v1/models/half_plus_two:predict", '{"inputs": [[-Infinity]]}')
    assert columns.content == b'{"outputs":[[-Infinity]]}'


def test_outputs_named_bytes_answer_in_base64(server):
    """g3doc/api_rest.md 'Output of binary values'; util/json_tensor.cc IsNamedTensorBytes."""
    raw = b"\xffimage"
    body = json.dumps({"instances": ["seaside", {"b64": base64.b64encode(raw).decode()}]})
    answer = post(server, "/v1/models/text:predict", body)
    assert answer.status_code == 200, answer.text
    b64 = lambda value: {"b64": base64.b64encode(value).decode()}  # noqa: E731
    assert answer.json() == {"predictions": [
        {"upper": "SEASIDE", "upper_bytes": b64(b"SEASIDE")},
        {"upper": b64(b"\xffIMAGE"), "upper_bytes": b64(b"\xffIMAGE")},
    ]}


def test_outputs_of_different_batch_sizes_answer_400(server):
    """util/json_tensor.cc MakeRowFormatJsonFromTensors: 'inconsistent batch size' is a 400.
    One row is consistent ('first' has one row too) and answers."""
    one = post(server, "/v1/models/uneven:predict", '{"instances": [3.0]}')
    assert one.status_code == 200, one.text
    assert one.json() == {"predictions": [{"first": 3.0, "y": 6.0}]}
    three = post(server, "/v1/models/uneven:predict", '{"instances": [1.0, 2.0, 3.0]}')
    assert three.status_code == 400
    assert "one row per input row" in three.json()["error"]


@pytest.mark.parametrize("method,path,message", [
    ("POST", "/v1/models/half_plus_two:predictx", "Malformed request: POST /v1/models/half_plus_two:predictx"),
    ("POST", "/v1/models/half_plus_two/versions/abc:predict",
     "Malformed request: POST /v1/models/half_plus_two/versions/abc:predict"),
    ("POST", "/v1/models/:predict", "Malformed request: POST /v1/models/:predict"),
    ("GET", "/v1/models/half_plus_two/versions/1/status",
     "Malformed request: GET /v1/models/half_plus_two/versions/1/status"),
    ("GET", "/v1/models", "Missing model name in request."),
    ("DELETE", "/v1/models/a:b", "Malformed request: DELETE /v1/models/a:b"),
])
def test_malformed_model_urls_answer_400_with_tf_servings_message(server, method, path, message):
    """model_servers/http_rest_api_handler.cc ProcessRequest and http_rest_api_util.cc
    (kPredictionApiGegex, kModelStatusApiRegex): a /v1/ path neither fits is 'Malformed request'."""
    answer = requests.request(method, server.url + path, data='{"instances": [1.0]}', timeout=TIMEOUT_S)
    assert answer.status_code == 400
    assert answer.headers["Content-Type"] == "application/json"
    assert answer.json() == {"error": message}


def test_well_formed_urls_naming_nothing_stay_404(server):
    """The same regexes fit these, so TF Serving answers them 'not found', not malformed."""
    for path in ("/v1/models/nope:predict", "/v1/models/..%2F..%2Fetc:predict"):
        assert post(server, path, '{"instances": [1.0]}').status_code == 404
    assert requests.get(server.url + "/v1/models/nope/metadata", timeout=TIMEOUT_S).status_code == 404
    assert requests.get(server.url + "/nope", timeout=TIMEOUT_S).status_code == 404


def test_too_many_rows_answer_413_before_the_rows_are_decoded(server):
    """Rows that could never decode still get the 413: the count comes first (issue: bounded cost)."""
    garbage = json.dumps({"instances": [["not", "a", "number"]] * (MAX_REQUEST_ROWS + 1)})
    answer = post(server, "/v1/models/half_plus_two:predict", garbage)
    assert answer.status_code == 413
    assert answer.json()["error"] == (f"the request holds {MAX_REQUEST_ROWS + 1} rows; this model takes at most "
                                      f"{MAX_REQUEST_ROWS} rows per request (MAX_REQUEST_ROWS)")
    fits = post(server, "/v1/models/half_plus_two:predict", json.dumps({"instances": [1.0] * MAX_REQUEST_ROWS}))
    assert fits.json() == {"predictions": [2.5] * MAX_REQUEST_ROWS}
