"""Edges of the Open Inference Protocol's REST door and of the text that becomes numbers and names.

In-process (Flask's test client, real models and engine): the wire is not what these test.
One app serves `exact` (integer weights) and `echo` (each v2 datatype answered unchanged), so
a NaN or an infinity sent in comes back out. tests/test_v2.py holds the live server.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from app import create_app, openapi, shutdown_app
from app.settings import Settings, SettingsError, model_configs, parse, validate_pos_int
from app.tfs_flags import FlagError, parse_flags
from tests.conftest import integer_rows
from tests.test_v2 import save_dtype_echo

INFER = "/v2/models/exact/infer"


@pytest.fixture(scope="module")
def app(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("v2_edges")
    save_dtype_echo(folder / "echo")
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "exact", "models": [
        {"name": "exact", "path": str(exact_model_path)}, {"name": "echo", "path": str(folder / "echo")}]}))
    served = create_app(Settings(model_config=str(config), access_log=False, model_poll_seconds=0))
    yield served
    shutdown_app(served, timeout_s=30)


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


def features(**overrides) -> dict:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4], **overrides}]}


def echo_body(fp32: list) -> dict:
    """The echo model's request: every input one row of two values; FP32 as given."""
    values = {"BOOL": [True, False], "BYTES": ["a", "b"], "FP32": fp32}
    names = ["BOOL", "BYTES", "FP16", "FP32", "FP64", "INT16", "INT32", "INT64", "INT8", "UINT16", "UINT32",
             "UINT64", "UINT8"]
    return {"inputs": [{"name": f"in_{name.lower()}", "datatype": name, "shape": [1, 2],
                        "data": values.get(name, [1, 2])} for name in names],
            "outputs": [{"name": "out_fp32"}]}


# -- 1. Unicode digits and names that end in a newline --------------------------------------


@pytest.mark.parametrize("length", ["²", "¹²", "١٢", "１２", " 3 4"])
def test_header_length_in_other_than_ascii_digits_is_a_400_naming_the_header(client, length):
    body = json.dumps(features()).encode()

    answer = client.post(INFER, data=body, headers={"Inference-Header-Content-Length": length})

    assert answer.status_code == 400, answer.text
    assert answer.json == {"error": f"Inference-Header-Content-Length must be a number of bytes within the "
                                    f"body's {len(body)}; got {length!r}"}


@pytest.mark.parametrize("text", ["１６", "١٦", "1_6", "²"])
def test_settings_take_ascii_digits_only(text):
    with pytest.raises(SettingsError, match=f"MAX_BATCH_SIZE={text!r}"):
        parse("MAX_BATCH_SIZE", text, validate_pos_int)
    with pytest.raises(FlagError, match="--port"):
        parse_flags([f"--port={text}", "--model_base_path=/m"])
    assert parse("MAX_BATCH_SIZE", " 16 ", validate_pos_int) == 16


def test_a_label_that_ends_in_a_newline_is_refused(tmp_path):
    config = tmp_path / "models.json"
    config.write_text(json.dumps({"models": [{"name": "m", "path": "/m", "version_labels": {"stable\n": 1}}]}))
    with pytest.raises(SettingsError, match=r"version_labels: 'stable\\n'"):
        model_configs(Settings(model_config=str(config)))


# -- 5. wrong-typed fields, and bodies the server cannot read -----------------------------


@pytest.mark.parametrize("body, message", [
    ({**features(), "parameters": {"binary_data_output": "yes"}},
     "the parameter 'binary_data_output' must be true or false"),
    ({**features(), "outputs": [{"name": "scores", "parameters": {"binary_data": "yes"}}]},
     "outputs[0].parameters.binary_data must be true or false"),
    ({**features(), "id": 5}, "'id' must be a string"),
    ({**features(), "id": {"a": [1, 2]}}, "'id' must be a string"),
    ({**features(), "parameters": {"signature_name": 1}}, "the parameter 'signature_name' must be a string"),
    ({**features(), "parameters": {"timeout": "5"}},
     "the parameter 'timeout' is microseconds, a whole number of 0 or more"),
], ids=["binary_data_output", "binary_data", "id number", "id object", "signature_name", "timeout"])
def test_wrong_typed_fields_are_a_400_naming_the_field(client, body, message):
    answer = client.post(INFER, json=body)

    assert answer.status_code == 400, answer.text
    assert answer.json == {"error": message}


@pytest.mark.parametrize("compressed", [True, False], ids=["gzipped", "plain body"])
def test_a_content_encoding_is_refused_as_unsupported(client, compressed):
    import gzip

    body = json.dumps(features()).encode()
    answer = client.post(INFER, data=gzip.compress(body) if compressed else body,
                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})

    assert answer.status_code == 415, answer.text
    assert answer.json == {"error": "Content-Encoding 'gzip' is not supported: send the body uncompressed"}
    assert client.post("/v1/models/exact:predict", data=body, headers={"Content-Encoding": "br"}).json == {
        "error": "Content-Encoding 'br' is not supported: send the body uncompressed"}
    assert client.post(INFER, data=body, headers={"Content-Encoding": "identity"}).status_code == 200


def test_a_string_id_is_echoed(client, exact_model):
    rows = integer_rows(2, seed=1)
    answer = client.post(INFER, json={"id": "r-1", **features(shape=[2, 4], data=rows.ravel().tolist())})
    assert answer.status_code == 200, answer.text
    assert answer.json["id"] == "r-1"
    assert answer.json["outputs"][0]["data"] == exact_model(rows).numpy().ravel().tolist()


# -- 8. NaN and infinities in JSON, as Triton writes and reads them ------------------------


def test_nan_and_infinities_go_in_and_come_back_as_tokens_not_null(client):
    body = json.dumps(echo_body([float("nan"), float("inf")])).encode()  # Python writes NaN, Infinity

    answer = client.post("/v2/models/echo/infer", data=body)

    assert answer.status_code == 200, answer.text
    assert b'"data":[NaN,Infinity]' in answer.data
    assert b"null" not in answer.data
    body = json.dumps(echo_body([-np.inf, 0.5])).encode()
    assert b'"data":[-Infinity,0.5]' in client.post("/v2/models/echo/infer", data=body).data


def test_a_number_too_big_for_a_double_is_still_malformed(client):
    body = json.dumps(echo_body([1, 2])).replace('"FP32", "shape": [1, 2], "data": [1, 2]',
                                                 '"FP32", "shape": [1, 2], "data": [1e400, NaN]').encode()
    answer = client.post("/v2/models/echo/infer", data=body)
    assert answer.status_code == 400
    assert answer.json == {"error": "malformed JSON: number 1e400 is too big for a double"}


# -- 6. the OpenAPI document and the routes served ------------------------------------------


def test_openapi_document_describes_every_route_the_app_serves_v2_included(app, client):
    served = client.get("/openapi.json").json

    assert {(path, method) for path, methods in served["paths"].items() for method in methods} == \
        openapi.operations(app)
    assert {path for path in served["paths"] if path.startswith("/v2")} == {
        "/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready",
        "/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}",
        "/v2/models/{name}/versions/{version}/ready", "/v2/models/{name}/versions/{version}/infer",
        "/v2/models/stats", "/v2/models/{name}/stats", "/v2/models/{name}/versions/{version}/stats",
        "/v2/repository/index", "/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload"}


def test_a_route_without_a_description_stops_start_up():
    from flask import Flask

    from app import api, metrics, v2_rest

    probe = Flask("probe")
    api.init_app(probe)
    metrics.init_app(probe)
    v2_rest.init_app(probe)
    probe.add_url_rule("/v2/secret", "secret", lambda: "", methods=["GET"])
    with pytest.raises(RuntimeError, match=r"not described \[\('/v2/secret', 'get'\)\], described but not "
                                           r"served \[\]"):
        openapi.init_app(probe)
