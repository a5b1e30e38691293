"""Edges of the Open Inference Protocol's REST door and of the text that becomes numbers and names.

In-process (Flask's test client, real models and engine): the wire is not what these test.
One app serves `exact` (integer weights) and `echo` (each v2 datatype answered unchanged), so
a NaN or an infinity sent in comes back out. tests/test_v2.py holds the live server.
"""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest

from app import create_app, shutdown_app
from app.core.errors import bounded
from app.http import openapi
from app.ops import logs
from app.ops.settings import Settings, SettingsError, model_configs, parse, validate_pos_int
from app.tfs_flags import FlagError, parse_flags
from app.wire import priority, v2_tensors
from tests.conftest import integer_rows
from tests.test_v2 import DTYPES, dtype_values, save_dtype_echo

INFER = "/v2/models/exact/infer"


@pytest.fixture(scope="module")
def app(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("v2_edges")
    save_dtype_echo(folder / "echo")
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "exact", "models": [
        {"name": "exact", "path": str(exact_model_path)}, {"name": "echo", "path": str(folder / "echo")}]}))
    access_off = logs.access_log.disabled
    served = create_app(Settings(model_config=str(config), access_log=False, model_poll_seconds=0))
    yield served
    shutdown_app(served, timeout_s=30)
    logs.access_log.disabled = access_off  # create_app set it for the whole process


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


# Past what int() reads (4,300 digits, CPython's limit): a ValueError, a 500 and a traceback if it got there.
LONG = "9" * 5000


@pytest.mark.parametrize("length", ["²", "¹²", "١٢", "１２", " 3 4", LONG], ids=[*"abcde", "5,000 digits"])
def test_header_length_in_other_than_ascii_digits_is_a_400_naming_the_header(client, length):
    body = json.dumps(features()).encode()

    answer = client.post(INFER, data=body, headers={"Inference-Header-Content-Length": length})

    assert answer.status_code == 400, answer.text
    assert answer.json == {"error": bounded(f"Inference-Header-Content-Length must be a number of bytes within the "
                                            f"body's {len(body)}; got {length!r}")}


@pytest.mark.parametrize("version", [LONG, str(2**63)], ids=["5,000 digits", "2**63"])
def test_a_version_past_int64_is_a_400_naming_it_on_every_route(client, version):
    v2_refusal = (400, {"error": bounded(f"failed to get model version from specified version string '{version}', "
                                         f"version should be an integral value from 0 to {2**63 - 1}")})
    for method, path in [("post", "/infer"), ("get", ""), ("get", "/ready"), ("get", "/stats")]:
        answer = getattr(client, method)(f"/v2/models/exact/versions/{version}{path}", json=features())
        assert (answer.status_code, answer.json) == v2_refusal, path
    # TF Serving's words, where absl::SimpleAtoi cannot read the URL's version as an int64.
    tf_refusal = (400, {"error": bounded(f"Failed to convert version: {version} to numeric.")})
    for method, path, body in [("post", ":predict", {"instances": [[1, 2, 3, 4]]}), ("post", ":classify", EXAMPLES),
                               ("post", ":regress", EXAMPLES), ("get", "", None), ("get", "/metadata", None)]:
        answer = getattr(client, method)(f"/v1/models/exact/versions/{version}{path}", json=body)
        assert (answer.status_code, answer.json) == tf_refusal, path
    # The largest int64 is a version, which this server does not have.
    assert client.get(f"/v1/models/exact/versions/{2**63 - 1}").status_code == 404
    assert client.get(f"/v2/models/exact/versions/{2**63 - 1}").status_code == 404


EXAMPLES = {"examples": [{"x": 1.0}]}


@pytest.mark.parametrize("path, body", [
    ("/v1/models/exact:predict", {"instances": [[1, 2, 3, 4]]}), ("/predict", {"instances": [[1, 2, 3, 4]]}),
    ("/v1/models/exact:classify", EXAMPLES), ("/v1/models/exact:regress", EXAMPLES)])
def test_an_x_priority_past_its_bound_is_a_400_naming_the_header(client, path, body):
    for value in (LONG, str(2**64)):
        answer = client.post(path, json=body, headers={"X-Priority": value})
        assert (answer.status_code, answer.json) == (400, {"error": priority.HEADER_ERROR}), path


def test_a_content_length_past_int64_is_over_the_body_limit(client):
    # Gunicorn answers 400 itself past 4,300 digits; any other WSGI server hands the text on.
    answer = client.post(INFER, data=b"{}", environ_overrides={"CONTENT_LENGTH": LONG})
    assert answer.status_code == 413, answer.text


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


def test_an_integer_beside_nan_is_read_as_orjson_reads_it(client):
    # Python's json reads the bodies that hold NaN: an integer past 64 bits is a double there too,
    # and one past a double's range (5,000 digits, past what int() reads) is refused in the same words.
    def fp64(data: str):
        body = json.dumps({**echo_body([1, 2]), "outputs": [{"name": "out_fp64"}]})
        fp64_input = '"datatype": "FP64", "shape": [1, 2], "data": [1, 2]'
        return client.post("/v2/models/echo/infer", data=body.replace(fp64_input, fp64_input[:-6] + data).encode())

    answer = fp64(f"[{LONG}, NaN]")
    assert (answer.status_code, answer.json) == (400, {"error": f"malformed JSON: number {LONG[:40]} is too big "
                                                                "for a double"})
    answer = fp64(f"[{2**64}, NaN]")
    assert answer.status_code == 200, answer.text
    assert b'"data":[1.8446744073709552e+19,NaN]' in answer.data


def test_a_number_too_big_for_a_double_is_still_malformed(client):
    body = json.dumps(echo_body([1, 2])).replace('"FP32", "shape": [1, 2], "data": [1, 2]',
                                                 '"FP32", "shape": [1, 2], "data": [1e400, NaN]').encode()
    answer = client.post("/v2/models/echo/infer", data=body)
    assert answer.status_code == 400
    assert answer.json == {"error": "malformed JSON: number 1e400 is too big for a double"}


@pytest.mark.parametrize("datatype, value", [("FP32", 3.5e38), ("FP32", -1e39), ("FP16", 70000)])
@pytest.mark.parametrize("reading", ["read at once", "item by item", "beside NaN"])
def test_a_value_past_the_float_range_is_refused_as_tf_serving_refuses_it(client, datatype, value, reading):
    # A finite number the datatype cannot hold would be computed on as infinity: refused, on every
    # path the JSON takes (simdjson's; numpy's with a boolean in the body; Python's, for NaN).
    data = {datatype: [value, 1], **({"BOOL": [True, False]} if reading == "item by item" else {})}
    if reading == "beside NaN":
        data[datatype] = [value, float("nan")]
    answer = echo_request(client, data)

    assert answer.status_code == 400, answer.text
    assert answer.json == {"error": f"input 'in_{datatype.lower()}': a value is outside the range of {datatype}"}
    if datatype == "FP32":  # the exact model takes float32
        tf_serving = client.post("/v1/models/exact:predict", json={"instances": [[value, 1, 2, 3]]})
        assert (tf_serving.status_code, tf_serving.json) == (
            400, {"error": "instances: a value is too large for DT_FLOAT (input 'features')"})


def test_infinity_spelled_out_and_the_largest_float_stay_what_they_are(client):
    answer = echo_request(client, {"FP32": [float("inf"), -3.4028235e38], "FP16": [65504, -65519]})

    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output["data"] for output in answer.json["outputs"]}
    assert outputs["out_fp32"] == [float("inf"), float(np.finfo(np.float32).min)]
    assert outputs["out_fp16"] == [65504.0, -65504.0]  # 65519 rounds to float16's largest, not to infinity


# -- 9. JSON data read by numpy at once, or item by item where it must be -------------------


def echo_request(client, data: dict[str, list]):
    """The echo model's answer to one row of each datatype: `data` where it names one, else the
    edges of its range; BOOL as binary data, so that the JSON holds no boolean (unless `data`
    gives BOOL's as JSON) and numpy may read each input's data whole."""
    inputs = []
    for name in DTYPES:
        tensor = {"name": f"in_{name.lower()}", "datatype": name, "shape": [1, 2]}
        if name in data or name != "BOOL":
            tensor["data"] = data.get(name, dtype_values(name, 1).tolist() if name != "BYTES" else ["a", "b"])
        else:
            tensor["parameters"] = {"binary_data_size": 2}
        inputs.append(tensor)
    header = json.dumps({"inputs": inputs, "outputs": [{"name": f"out_{name.lower()}"} for name in DTYPES]}).encode()
    binary = b"" if "BOOL" in data else b"\x01\x00"
    return client.post("/v2/models/echo/infer", data=header + binary,
                       headers={"Inference-Header-Content-Length": str(len(header))})


def test_every_datatype_at_the_edges_of_its_range_read_at_once_comes_back_unchanged(client):
    answer = echo_request(client, {"FP32": [[2 ** 60 + 2 ** 36 + 1], [0.5]], "FP64": [[1e300, -2]]})

    assert answer.status_code == 200, answer.text
    outputs = {output["name"]: output["data"] for output in answer.json["outputs"]}
    for name in DTYPES:
        if name not in ("BOOL", "BYTES", "FP32", "FP64"):
            assert outputs[f"out_{name.lower()}"] == dtype_values(name, 1).ravel().tolist(), name
    assert outputs["out_bool"] == [True, False]
    # A whole number becomes FP32 through a double, as Python's float() rounds it: 2**60, not 2**60 + 2**37.
    assert outputs["out_fp32"] == [float(np.float32(float(2 ** 60 + 2 ** 36 + 1))), 0.5] == [2.0 ** 60, 0.5]
    assert outputs["out_fp64"] == [1e300, -2.0]


@pytest.mark.parametrize("data, message", [
    ({"INT8": [300, 1]}, "input 'in_int8': a value is outside the range of INT8"),
    ({"UINT8": [-1, 1]}, "input 'in_uint8': a value is outside the range of UINT8"),
    ({"INT64": [2 ** 63, 1]}, "input 'in_int64': a value is outside the range of INT64"),
    ({"UINT64": [2 ** 64 - 1, -1]}, "input 'in_uint64': a value is outside the range of UINT64"),
    ({"INT32": [1.5, 2]}, "input 'in_int32': INT32 data must be numbers"),
    ({"FP32": ["1.5", 2]}, "input 'in_fp32': FP32 data must be numbers"),
    ({"FP32": [None, 2]}, "input 'in_fp32': FP32 data must be numbers"),
    ({"FP32": [True, 2]}, "input 'in_fp32': FP32 data must be numbers"),
    ({"INT16": [1, False]}, "input 'in_int16': INT16 data must be numbers"),
    ({"BOOL": [1, 0]}, "input 'in_bool': BOOL data must be booleans"),
    ({"FP16": [[1], [2, 3]]}, "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ({"FP64": [[1, 2], [3, 4]]}, "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ({"UINT16": 7}, "input 'in_uint16': 'data' must be a JSON array"),
], ids=["INT8 300", "UINT8 -1", "INT64 2**63", "2**64-1 beside -1", "a float for INT32", "a string", "null",
        "true for FP32", "false for INT16", "numbers for BOOL", "ragged", "too many", "not an array"])
def test_json_data_numpy_would_misread_is_refused_in_the_item_by_item_words(client, data, message):
    answer = echo_request(client, data)

    assert answer.status_code == 400, answer.text
    assert answer.json == {"error": message}


VALUES = [0, 1, -1, 255, 256, -129, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, -2 ** 63, 10 ** 30, 1.5, -0.0,
          1e300, float("nan"), float("inf"), 2 ** 60 + 2 ** 36 + 1, 65504.0, 1e-45, "1", None]


@pytest.mark.parametrize("name", [name for name in v2_tensors.DATATYPES if name != "BYTES"])
def test_json_data_read_at_once_is_what_the_item_by_item_reading_makes(name):
    # Every pair of values, flat and nested, counted right and wrong: the same array or the same words.
    dtype = v2_tensors.DATATYPES[name]

    def read(reader, *args, **kwargs):
        try:
            array = reader(*args, **kwargs)
        except v2_tensors.InvalidInput as exc:
            return str(exc)
        return array.dtype, array.shape, array.tobytes()

    compared = 0
    for first in VALUES:
        for second in VALUES:
            for data in ([first, second], [[first], [second]], [[first], [second, second]]):
                for count in (2, 3):
                    by_item = read(v2_tensors._from_json_by_item, data, dtype, count, "x")
                    assert read(v2_tensors._from_json, data, dtype, count, "x", booleans=False) == by_item, data
                    compared += 1
    assert compared == len(VALUES) ** 2 * 6


def test_bf16_takes_integers_past_64_bits_item_by_item_as_float_reads_them():
    # JSON booleans anywhere in a body send its data item by item (no served model takes BF16).
    bf16 = v2_tensors.DATATYPES["BF16"]
    array = v2_tensors._from_json([[2 ** 64], [10 ** 30]], bf16, 2, "x", booleans=True)

    assert array.dtype == bf16
    assert array.tobytes() == np.array([float(2 ** 64), float(10 ** 30)]).astype(bf16).tobytes()
    with pytest.raises(v2_tensors.InvalidInput, match="^x: a value is outside the range of BF16$"):
        v2_tensors._from_json([10 ** 400, 1], bf16, 2, "x", booleans=True)
    # Past bfloat16's range, but not a double's: refused on both readings, never infinity.
    for data in ([3.4e38, 1], np.array([3.4e38, 1])):
        with pytest.raises(v2_tensors.InvalidInput, match="^x: a value is outside the range of BF16$"):
            v2_tensors._from_json(data, bf16, 2, "x", booleans=False)


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
        "/v2/models/{name}/config", "/v2/models/{name}/versions/{version}/config",
        "/v2/repository/index", "/v2/repository/models/{name}/load", "/v2/repository/models/{name}/unload"}


def test_a_route_without_a_description_stops_start_up():
    from types import SimpleNamespace

    from flask import Flask

    from app.http import routes
    from app.http.app import DOORS, metrics_view
    from app.ops.settings import Settings

    probe = Flask("probe")
    routes.init_app(probe)
    for name, table in DOORS:
        routes.register(probe, SimpleNamespace(settings=Settings()), name, table)
    probe.add_url_rule("/metrics", "metrics", metrics_view, methods=["GET"])
    probe.add_url_rule("/v2/secret", "secret", lambda: "", methods=["GET"])
    with pytest.raises(RuntimeError, match=r"not described \[\('/v2/secret', 'get'\)\], described but not "
                                           r"served \[\]"):
        openapi.init_app(probe)


def test_a_string_among_many_numbers_is_found_without_numpy_writing_them_as_text(monkeypatch):
    # numpy reads one string among a million numbers by writing every number as text (0.4 s):
    # past MAX_SCAN values the string is looked for first, and the item-by-item walk words it.
    reads = []
    real_array = np.array
    monkeypatch.setattr(np, "array", lambda *args, **kwargs: reads.append(kwargs) or real_array(*args, **kwargs))
    numbers = [[0.5, 1.5]] * (v2_tensors.codec.MAX_SCAN // 2 + 1)
    fp32 = v2_tensors.DATATYPES["FP32"]

    with pytest.raises(v2_tensors.InvalidInput, match="^x: FP32 data must be numbers$"):
        v2_tensors._from_json([*numbers, ["a", 1.5]], fp32, len(numbers) * 2 + 2, "x", booleans=False)
    assert reads == []
    read = v2_tensors._from_json(numbers, fp32, len(numbers) * 2, "x", booleans=False)
    assert reads == [{}]  # numpy read the numbers at once
    np.testing.assert_array_equal(read, real_array(numbers, dtype=np.float32).ravel())


@pytest.mark.parametrize("name", [name for name in v2_tensors.DATATYPES if name != "BYTES"])
def test_an_outputs_json_is_the_text_of_its_python_values(name):
    # orjson writes the array straight from numpy: the same text as the values' tolist() (floats
    # as their float64), at every edge of the range, and NaN and infinities as tokens.
    dtype = v2_tensors.DATATYPES[name]
    rng = np.random.default_rng(5)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        array = np.concatenate([rng.integers(info.min, info.max, 60, dtype=dtype, endpoint=True),
                                np.array([info.min, info.max, 0], dtype=dtype)])
    elif dtype.kind == "b":
        array = np.array([True, False, True])
    else:
        with np.errstate(over="ignore"):
            array = (rng.standard_normal(60) * 10.0 ** rng.integers(-40, 40, 60)).astype(dtype)
        array[~np.isfinite(array.astype(np.float64))] = 1  # past FP16's range: the tokens are below
    array = array.reshape(-1, 3)

    written = orjson.dumps({"data": v2_tensors.to_json(array, "out")})

    values = array.astype(np.float64) if dtype.kind in "fV" else array
    assert written == orjson.dumps({"data": values.ravel().tolist()})
    if dtype.kind in "fV":
        tokens = np.array([np.nan, np.inf, -np.inf, 1.5], dtype=dtype)
        assert orjson.dumps({"data": v2_tensors.to_json(tokens, "out")}) == b'{"data":[NaN,Infinity,-Infinity,1.5]}'
