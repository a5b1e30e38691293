"""The Open Inference Protocol (KServe v2) over HTTP and gRPC, driven by Triton's own unmodified clients.

A live `gunicorn -c gunicorn.conf.py wsgi:app` serves: `exact` (integer weights, so answers
compare with ==), `held` (the same model behind a long batch window, so requests of both
APIs are seen to share one predict call), `tss` (three inputs, three outputs, strings),
`dtypes` (one input of every v2 datatype, each echoed back), `multi` (two signatures) and
`versioned` (versions 1 and 2, labels stable and canary). tritonclient.http sends binary
tensor data by default; each HTTP prediction test runs binary and JSON. tritonclient.grpc
sends raw_input_contents; typed `contents` are sent with the generated stub.
"""

from __future__ import annotations

import json
import threading

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import Server, build_exact_model, integer_rows
from tests.test_signatures import save_multi_signature
from tests.test_tf_serving import save_tag_signal_sensor

HELD_WINDOW_MS = 20_000
HELD_BATCH = 8
MAX_ROWS = 64  # MAX_REQUEST_ROWS 0: twice MAX_BATCH_SIZE (32)
DTYPES = {
    "BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}


def save_dtype_echo(path) -> None:
    """One [None, 2] input per v2 datatype, `in_<type>`, answered unchanged as `out_<type>`."""
    import tensorflow as tf

    tf_types = {"BOOL": tf.bool, "INT8": tf.int8, "INT16": tf.int16, "INT32": tf.int32, "INT64": tf.int64,
                "UINT8": tf.uint8, "UINT16": tf.uint16, "UINT32": tf.uint32, "UINT64": tf.uint64,
                "FP16": tf.float16, "FP32": tf.float32, "FP64": tf.float64, "BYTES": tf.string}
    names = sorted(tf_types)

    class Echo(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf_types[name], name=f"in_{name.lower()}")
                                      for name in names])
        def serve(self, *tensors):
            return {f"out_{name.lower()}": tf.identity(tensor) for name, tensor in zip(names, tensors, strict=True)}

    module = Echo()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def dtype_values(name: str, rows: int) -> np.ndarray:
    """Values at the edges of each datatype's range, so a wrong width or sign cannot pass."""
    if name == "BOOL":
        return np.array([[True, False], [False, True]] * rows, dtype=np.bool_)[:rows]
    if name == "BYTES":
        return np.array([[f"r{row}".encode(), "héllo".encode()] for row in range(rows)], dtype=np.object_)
    dtype = np.dtype(DTYPES[name])
    if dtype.kind == "f":
        base = np.array([1.5, -2.25], dtype=dtype) if name != "FP16" else np.array([65504, -0.5], dtype=dtype)
    else:
        info = np.iinfo(dtype)
        base = np.array([info.min, info.max], dtype=dtype)
    return np.stack([base] * rows)


@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path):
    folder = tmp_path_factory.mktemp("v2")
    save_tag_signal_sensor(folder / "tss")
    save_dtype_echo(folder / "dtypes")
    save_multi_signature(folder / "multi")
    for version, seed in ((1, 7), (2, 8)):
        build_exact_model(seed=seed).export(str(folder / "versioned" / str(version)), format="tf_saved_model",
                                            verbose=False)
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "exact", "models": [
        {"name": "exact", "path": str(exact_model_path)},
        {"name": "held", "path": str(exact_model_path), "batch_timeout_ms": HELD_WINDOW_MS,
         "max_batch_size": HELD_BATCH},
        {"name": "tss", "path": str(folder / "tss")},
        {"name": "dtypes", "path": str(folder / "dtypes")},
        {"name": "multi", "path": str(folder / "multi")},
        {"name": "versioned", "path": str(folder / "versioned"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}},
    ]}))
    server = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_POLL_SECONDS": "0"})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{served.port}", network_timeout=60)
    yield client
    client.close()


def infer(client, model: str, arrays: dict[str, np.ndarray], *, binary: bool, outputs: list[str] | None = None,
          **kwargs):
    inputs = []
    for name, array in arrays.items():
        tensor = httpclient.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in outputs or []]
    return client.infer(model, inputs, outputs=requested or None, **kwargs)


def _datatype(array: np.ndarray) -> str:
    return next(name for name, dtype in DTYPES.items() if np.dtype(dtype) == array.dtype)


# -- health and metadata ----------------------------------------------------------------------


def test_health_and_server_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("exact")
    assert client.is_model_ready("versioned", "1")
    assert not client.is_model_ready("versioned", "3")
    assert not client.is_model_ready("nothing")
    metadata = client.get_server_metadata()
    assert metadata["extensions"] == ["binary_tensor_data", "statistics", "model_repository", "model_configuration"]


def test_model_metadata_names_datatypes_and_variable_dimensions(client):
    metadata = client.get_model_metadata("tss")
    assert metadata == {
        "name": "tss", "versions": ["1"], "platform": "tensorflow",
        "inputs": [{"name": "sensor", "datatype": "FP32", "shape": [-1, 2, 2]},
                   {"name": "signal", "datatype": "FP32", "shape": [-1, 5]},
                   {"name": "tag", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": "sensor_max", "datatype": "FP32", "shape": [-1]},
                    {"name": "signal_sum", "datatype": "FP32", "shape": [-1]},
                    {"name": "tag_length", "datatype": "INT32", "shape": [-1]}],
    }
    assert client.get_model_metadata("versioned")["versions"] == ["1", "2"]
    dtypes = client.get_model_metadata("dtypes")
    assert {tensor["name"]: tensor["datatype"] for tensor in dtypes["inputs"]} == {
        f"in_{name.lower()}": name for name in DTYPES}


# -- predictions ------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_answers_the_models_own_output_row_for_row(client, exact_model, binary):
    rows = integer_rows(13, seed=3)

    result = infer(client, "exact", {"features": rows}, binary=binary, outputs=None if binary else ["scores"])

    np.testing.assert_array_equal(result.as_numpy("scores"), exact_model(rows).numpy())
    response = result.get_response()
    assert (response["model_name"], response["model_version"]) == ("exact", "1")
    assert ("parameters" in response["outputs"][0]) is binary


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_several_inputs_and_a_subset_of_the_outputs(client, binary):
    arrays = {"tag": np.array([b"foo", "héllo".encode(), b""], dtype=np.object_),
              "signal": np.arange(15, dtype=np.float32).reshape(3, 5),
              "sensor": np.arange(12, dtype=np.float32).reshape(3, 2, 2)}

    result = infer(client, "tss", arrays, binary=binary, outputs=["tag_length", "sensor_max"])

    assert [output["name"] for output in result.get_response()["outputs"]] == ["tag_length", "sensor_max"]
    np.testing.assert_array_equal(result.as_numpy("tag_length"), [3, 6, 0])
    np.testing.assert_array_equal(result.as_numpy("sensor_max"), [3.0, 7.0, 11.0])
    assert result.as_numpy("signal_sum") is None


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_every_datatype_goes_in_and_comes_back_unchanged(client, binary):
    arrays = {f"in_{name.lower()}": dtype_values(name, 3) for name in DTYPES}

    result = infer(client, "dtypes", arrays, binary=binary, outputs=[f"out_{name.lower()}" for name in DTYPES])

    for name, dtype in DTYPES.items():
        answer, expected = result.as_numpy(f"out_{name.lower()}"), dtype_values(name, 3)
        if name == "BYTES" and not binary:
            # JSON carries BYTES as text, and tritonclient gives the text back as str.
            expected = np.vectorize(bytes.decode, otypes=[object])(expected)
        assert answer.dtype == np.dtype(dtype), name
        np.testing.assert_array_equal(answer, expected, err_msg=name)


@pytest.mark.parametrize("listed, every, own, binary", [
    (True, None, None, False), (True, True, None, False), (True, True, False, False), (True, None, True, True),
    (True, False, True, True), (False, True, None, True), (False, False, None, False), (False, None, None, False),
])
def test_an_outputs_own_binary_data_decides_and_the_requests_only_for_outputs_not_listed(
        served, exact_model, listed, every, own, binary):
    """As Triton (http_server.cc): `binary_data_output` is the form of the outputs a request does not
    list; a listed output is binary only if its own `binary_data` says so."""
    rows = integer_rows(2, seed=12)
    body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 4], "data": rows.ravel().tolist()}],
            **({"outputs": [{"name": "scores", **({} if own is None else {"parameters": {"binary_data": own}})}]}
               if listed else {}),
            **({} if every is None else {"parameters": {"binary_data_output": every}})}

    answer = post(served, "/v2/models/exact/infer", json.dumps(body).encode())

    assert answer.status_code == 200, answer.text
    length = int(answer.headers.get("Inference-Header-Content-Length", len(answer.content)))
    (output,) = json.loads(answer.content[:length])["outputs"]
    if binary:
        assert output["parameters"] == {"binary_data_size": 24} and "data" not in output
        values = np.frombuffer(answer.content[length:], "<f4")
    else:
        assert "parameters" not in output and length == len(answer.content)
        values = np.array(output["data"], np.float32)
    np.testing.assert_array_equal(values.reshape(2, 3), exact_model(rows).numpy())


def test_version_in_the_url_and_labels_pin_the_version(client):
    rows = integer_rows(4, seed=5)
    for version, seed in (("1", 7), ("2", 8), ("stable", 7), ("canary", 8)):
        result = infer(client, "versioned", {"features": rows}, binary=True, model_version=version)
        assert result.get_response()["model_version"] == ("1" if seed == 7 else "2")
        expected = build_exact_model(seed=seed)(rows).numpy()
        np.testing.assert_array_equal(result.as_numpy("output_0"), expected)  # the export's output name


def test_signature_name_parameter_selects_a_signature(client):
    z = np.array([[1, 2], [3, 4]], dtype=np.float32)
    result = infer(client, "multi", {"z": z}, binary=True, parameters={"signature_name": "triple"})
    np.testing.assert_array_equal(result.as_numpy("w"), 3 * z)
    x = np.array([2, 4], dtype=np.float32)
    np.testing.assert_array_equal(infer(client, "multi", {"x": x}, binary=False).as_numpy("y"), [3.0, 4.0])


def test_32_concurrent_clients_are_answered_exactly(served, exact_model):
    client = httpclient.InferenceServerClient(url=f"127.0.0.1:{served.port}", concurrency=32, network_timeout=60)
    try:
        batches = {index: integer_rows(1 + index % 4, seed=100 + index) for index in range(32)}
        pending = {}
        for index, rows in batches.items():
            tensor = httpclient.InferInput("features", list(rows.shape), "FP32")
            tensor.set_data_from_numpy(rows, binary_data=index % 2 == 0)
            pending[index] = client.async_infer("exact", [tensor])
        for index, request in pending.items():
            np.testing.assert_array_equal(request.get_result().as_numpy("scores"),
                                          exact_model(batches[index]).numpy())
    finally:
        client.close()


def test_v2_and_tf_serving_requests_share_one_predict_call(served, client, exact_model):
    """HELD_BATCH one-row requests, half of each API, fill one batch of `held` and go in one call."""
    rows = integer_rows(HELD_BATCH, seed=11)
    answers: dict[int, np.ndarray] = {}

    def v2(index: int) -> None:
        answers[index] = infer(client_for(served), "held", {"features": rows[index: index + 1]},
                               binary=index % 4 == 0).as_numpy("scores")

    def tf_serving(index: int) -> None:
        answer = served.predict(rows[index: index + 1], path="/v1/models/held:predict")
        answers[index] = np.asarray(answer.json()["predictions"], dtype=np.float32)

    threads = [threading.Thread(target=v2 if index % 2 else tf_serving, args=(index,)) for index in range(HELD_BATCH)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    for index in range(HELD_BATCH):
        np.testing.assert_array_equal(answers[index], exact_model(rows[index: index + 1]).numpy())
    assert served.metric("model_server_batch_size_requests_count", model="held") == 1
    assert served.metric("model_server_batch_size_requests_sum", model="held") == HELD_BATCH
    assert served.metric("model_server_requests_total", route="/v2/models/<model_name:name>/infer",
                         status="200") >= HELD_BATCH // 2


def client_for(served):
    # One client per thread: tritonclient's HTTP client is not shared across threads.
    return httpclient.InferenceServerClient(url=f"127.0.0.1:{served.port}", network_timeout=60)


# -- errors -----------------------------------------------------------------------------------


def post(served, path: str, body: bytes, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(served.url + path, data=body, headers=headers or {}, timeout=60)


def features(**overrides) -> dict:
    tensor = {"name": "features", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}
    return {"inputs": [{**tensor, **overrides}]}


def framed(header: dict, binary: bytes, *, length: str | None = None) -> tuple[bytes, dict[str, str]]:
    text = json.dumps(header).encode()
    return text + binary, {"Inference-Header-Content-Length": length if length is not None else str(len(text))}


FOUR_FLOATS = np.arange(4, dtype=np.float32).tobytes()
BAD_REQUESTS = {
    "unknown model": ("/v2/models/nothing/infer", json.dumps(features()).encode(), None, 404,
                      "Request for unknown model: 'nothing' is not found"),
    "unknown version": ("/v2/models/exact/versions/9/infer", json.dumps(features()).encode(), None, 404,
                        "Request for unknown model: 'exact' version 9 is not found"),
    "unknown label": ("/v2/models/versioned/versions/beta/infer", json.dumps(features()).encode(), None, 400,
                      "failed to get model version from specified version string 'beta': it is neither a "
                      "version number nor a version label of model 'versioned'"),
    "wrong datatype": ("/v2/models/exact/infer", json.dumps(features(datatype="FP64")).encode(), None, 400,
                       "input 'features' takes datatype FP32; the request sent FP64"),
    "wrong shape": ("/v2/models/exact/infer", json.dumps(features(shape=[1, 3], data=[1, 2, 3])).encode(), None,
                    400, "input 'features' takes shape [-1, 4]; the request sent [1, 3]"),
    "data short of the shape": ("/v2/models/exact/infer", json.dumps(features(shape=[2, 4])).encode(), None, 400,
                                "Failed to parse 'data' field: shape does not match true shape"),
    "strings for floats": ("/v2/models/exact/infer", json.dumps(features(data=["a", "b", "c", "d"])).encode(),
                           None, 400, "input 'features': FP32 data must be numbers"),
    "value out of range": ("/v2/models/dtypes/infer", json.dumps({"inputs": [
        {"name": f"in_{name.lower()}", "datatype": name, "shape": [1, 2],
         "data": {"INT8": [300, 1], "BYTES": ["a", "b"]}.get(name, dtype_values(name, 1).ravel().tolist())}
        for name in DTYPES]}).encode(), None, 400, "input 'in_int8': a value is outside the range of INT8"),
    "an input twice": ("/v2/models/exact/infer", json.dumps({"inputs": features()["inputs"] * 2}).encode(), None, 400,
                       "takes the inputs {features}, each once; the request gave ['features', 'features']"),
    "unknown input": ("/v2/models/exact/infer", json.dumps(features(name="x")).encode(), None, 400,
                      "the model's signature 'serving_default' takes the inputs {features}"),
    "unknown output": ("/v2/models/exact/infer", json.dumps({**features(), "outputs": [{"name": "nope"}]}).encode(),
                       None, 400, "output tensor alias not found in signature: nope"),
    "unknown signature": ("/v2/models/exact/infer",
                          json.dumps({**features(), "parameters": {"signature_name": "nope"}}).encode(), None, 400,
                          'Serving signature name: "nope" not found'),
    "too many rows": ("/v2/models/exact/infer", json.dumps(features(shape=[MAX_ROWS + 1, 4])).encode(), None, 413,
                      f"this model takes at most {MAX_ROWS} rows"),
    "malformed JSON": ("/v2/models/exact/infer", b'{"inputs": [', None, 400, "malformed JSON"),
    "not an object": ("/v2/models/exact/infer", b"[1, 2]", None, 400, "must be a JSON object"),
    "no inputs": ("/v2/models/exact/infer", b"{}", None, 400, "'inputs' must be a JSON array"),
    "header length not a number": ("/v2/models/exact/infer", *framed(features(), b"", length="ten"), 400,
                                   "Inference-Header-Content-Length must be a number of bytes"),
    "header length in Unicode digits": ("/v2/models/exact/infer", *framed(features(), b"", length="²"), 400,
                                        "Inference-Header-Content-Length must be a number of bytes within the "
                                        "body's 93; got '²'"),
    "header length past the body": ("/v2/models/exact/infer", *framed(features(), b"", length="9999"), 400,
                                    "Inference-Header-Content-Length must be a number of bytes within"),
    "binary size past the body": ("/v2/models/exact/infer",
                                  *framed(features(data=None, parameters={"binary_data_size": 32}), FOUR_FLOATS[:8]),
                                  400, "binary_data_size 32 does not fit the 8 bytes"),
    "binary data nobody claims": ("/v2/models/exact/infer",
                                  *framed(features(parameters={"binary_data_size": 16}), FOUR_FLOATS + b"xx"),
                                  400, "2 bytes of binary data that no input's binary_data_size claims"),
    "binary size wrong for the shape": ("/v2/models/exact/infer",
                                        *framed(features(shape=[2, 4], parameters={"binary_data_size": 16}),
                                                FOUR_FLOATS), 400,
                                        "input 'features': its data holds 16 bytes; its shape and datatype need 32"),
    "BYTES element past its data": ("/v2/models/tss/infer", *framed({"inputs": [
        {"name": "tag", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}},
        {"name": "signal", "datatype": "FP32", "shape": [1, 5], "data": [0, 0, 0, 0, 0]},
        {"name": "sensor", "datatype": "FP32", "shape": [1, 2, 2], "data": [0, 0, 0, 0]}]},
        b"\x09\x00\x00\x00ab"), 400, "BYTES element 0 says 9 bytes; 2 are left"),
    "BYTES past its elements": ("/v2/models/tss/infer", *framed({"inputs": [
        {"name": "tag", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 7}},
        {"name": "signal", "datatype": "FP32", "shape": [1, 5], "data": [0, 0, 0, 0, 0]},
        {"name": "sensor", "datatype": "FP32", "shape": [1, 2, 2], "data": [0, 0, 0, 0]}]},
        b"\x01\x00\x00\x00abc"), 400, "its data holds 2 bytes past its 1 BYTES elements"),
    "BOOL byte not 0 or 1": ("/v2/models/dtypes/infer", *framed({"inputs": [
        {"name": f"in_{name.lower()}", "datatype": name, "shape": [1, 2],
         **({"parameters": {"binary_data_size": 2}} if name == "BOOL" else
            {"data": ["a", "b"] if name == "BYTES" else dtype_values(name, 1).ravel().tolist()})}
        for name in DTYPES]}, b"\x01\x02"), 400, "input 'in_bool': a BOOL element is a byte of 0 or 1"),
}


@pytest.mark.parametrize("case", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_clear_4xx(served, case):
    path, body, headers, status, message = case

    answer = post(served, path, body, headers)

    assert answer.status_code == status, answer.text
    assert message in answer.json()["error"]


def test_tritonclient_raises_the_servers_error(client):
    tensor = httpclient.InferInput("features", [1, 4], "FP64")
    tensor.set_data_from_numpy(np.zeros((1, 4), np.float64))
    with pytest.raises(InferenceServerException, match="takes datatype FP32; the request sent FP64"):
        client.infer("exact", [tensor])
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nothing' is not found"):
        client.get_model_metadata("nothing")


def test_model_ready_and_metadata_answer_status_codes_and_signatures(served):
    assert requests.get(served.url + "/v2/models/versioned/versions/2/ready", timeout=30).json() == {
        "name": "versioned", "ready": True}
    assert requests.get(served.url + "/v2/models/versioned/versions/3/ready", timeout=30).status_code == 404
    assert requests.get(served.url + "/v2/models/nothing/ready", timeout=30).status_code == 404
    triple = requests.get(served.url + "/v2/models/multi?signature_name=triple", timeout=30).json()
    assert triple["inputs"] == [{"name": "z", "datatype": "FP32", "shape": [-1, 2]}]


def test_the_timeout_parameter_caps_the_deadline(served):
    """`held` waits HELD_WINDOW_MS for a batch to fill: a 0.3 s timeout ends the request first."""
    body = {**features(), "parameters": {"timeout": 300_000}}
    answer = post(served, "/v2/models/held/infer", json.dumps(body).encode())
    assert answer.status_code == 504, answer.text


def test_unknown_v2_route_and_method(served):
    assert requests.get(served.url + "/v2/nothing", timeout=30).status_code == 404
    answer = requests.get(served.url + "/v2/models/exact/infer", timeout=30)
    assert answer.status_code == 405
    assert "error" in answer.json()


# -- gRPC -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_client(served):
    client = grpcclient.InferenceServerClient(url=served.grpc_target)
    yield client
    client.close()


def grpc_infer(client, model: str, arrays: dict[str, np.ndarray], *, outputs: list[str] | None = None, **kwargs):
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    requested = [grpcclient.InferRequestedOutput(name) for name in outputs or []]
    return client.infer(model, inputs, outputs=requested or None, client_timeout=60, **kwargs)


def test_grpc_health_and_metadata(grpc_client):
    assert grpc_client.is_server_live()
    assert grpc_client.is_server_ready()
    assert grpc_client.is_model_ready("exact")
    assert grpc_client.is_model_ready("versioned", "stable")
    assert not grpc_client.is_model_ready("versioned", "3")
    assert not grpc_client.is_model_ready("nothing")
    assert list(grpc_client.get_server_metadata().extensions) == [
        "binary_tensor_data", "statistics", "model_repository", "model_configuration"]
    metadata = grpc_client.get_model_metadata("tss", as_json=True)
    assert metadata["inputs"][0] == {"name": "sensor", "datatype": "FP32", "shape": ["-1", "2", "2"]}
    assert metadata["outputs"][2] == {"name": "tag_length", "datatype": "INT32", "shape": ["-1"]}
    assert grpc_client.get_model_metadata("versioned").versions == ["1", "2"]


def test_grpc_infer_answers_the_models_own_output_row_for_row(grpc_client, exact_model):
    rows = integer_rows(13, seed=4)

    result = grpc_infer(grpc_client, "exact", {"features": rows})

    np.testing.assert_array_equal(result.as_numpy("scores"), exact_model(rows).numpy())
    response = result.get_response()
    assert (response.model_name, response.model_version) == ("exact", "1")


def test_grpc_several_inputs_a_subset_of_the_outputs_and_every_datatype(grpc_client):
    arrays = {"tag": np.array([b"foo", "héllo".encode(), b""], dtype=np.object_),
              "signal": np.arange(15, dtype=np.float32).reshape(3, 5),
              "sensor": np.arange(12, dtype=np.float32).reshape(3, 2, 2)}
    result = grpc_infer(grpc_client, "tss", arrays, outputs=["tag_length", "sensor_max"])
    assert [output.name for output in result.get_response().outputs] == ["tag_length", "sensor_max"]
    np.testing.assert_array_equal(result.as_numpy("tag_length"), [3, 6, 0])
    np.testing.assert_array_equal(result.as_numpy("sensor_max"), [3.0, 7.0, 11.0])

    echoed = grpc_infer(grpc_client, "dtypes", {f"in_{name.lower()}": dtype_values(name, 2) for name in DTYPES})
    for name, dtype in DTYPES.items():
        answer = echoed.as_numpy(f"out_{name.lower()}")
        assert answer.dtype == np.dtype(dtype), name
        np.testing.assert_array_equal(answer, dtype_values(name, 2), err_msg=name)


def test_grpc_versions_labels_and_signature_parameter(grpc_client):
    rows = integer_rows(3, seed=6)
    for version, seed in (("2", 8), ("stable", 7)):
        result = grpc_infer(grpc_client, "versioned", {"features": rows}, model_version=version)
        np.testing.assert_array_equal(result.as_numpy("output_0"), build_exact_model(seed=seed)(rows).numpy())
    z = np.array([[1, 2]], dtype=np.float32)
    result = grpc_infer(grpc_client, "multi", {"z": z}, parameters={"signature_name": "triple"})
    np.testing.assert_array_equal(result.as_numpy("w"), 3 * z)


def test_grpc_typed_contents_are_read_too(served, exact_model):
    rows = integer_rows(2, seed=9)
    request = service_pb2.ModelInferRequest(model_name="exact")
    tensor = request.inputs.add(name="features", datatype="FP32", shape=[2, 4])
    tensor.contents.fp32_contents.extend(rows.ravel().tolist())
    with grpc.insecure_channel(served.grpc_target) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    output = response.outputs[0]
    assert (output.name, output.datatype, list(output.shape)) == ("scores", "FP32", [2, 3])
    np.testing.assert_array_equal(np.frombuffer(response.raw_output_contents[0], "<f4").reshape(2, 3),
                                  exact_model(rows).numpy())


def _raw_request(model: str = "exact", *, datatype: str = "FP32", shape=(1, 4), raw: list[bytes] | None = None,
                 **parameters) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name="features", datatype=datatype, shape=list(shape))
    request.raw_input_contents.extend(FOUR_FLOATS_LIST if raw is None else raw)
    for key, value in parameters.items():
        request.parameters[key].string_param = value
    return request


def _typed_beside_raw() -> service_pb2.ModelInferRequest:
    """raw_input_contents says 0, 1, 2, 3; the typed contents beside it say otherwise."""
    request = _raw_request()
    request.inputs[0].contents.fp32_contents.extend([9, 9, 9, 9])
    return request


def _parameter(name: str, **value) -> service_pb2.ModelInferRequest:
    request = _raw_request()
    field, given = next(iter(value.items()))
    setattr(request.parameters[name], field, given)
    return request


FOUR_FLOATS_LIST = [np.arange(4, dtype=np.float32).tobytes()]
TIMEOUT_REFUSED = "the parameter 'timeout' is microseconds, a whole number of 0 or more"
BAD_GRPC = {
    "typed contents beside raw": (_typed_beside_raw(), grpc.StatusCode.INVALID_ARGUMENT,
                                  "contents field must not be specified when using raw_input_contents for "
                                  "'features' for model 'exact'"),
    "timeout as text": (_parameter("timeout", string_param="300000"), grpc.StatusCode.INVALID_ARGUMENT,
                        TIMEOUT_REFUSED),
    "timeout as a boolean": (_parameter("timeout", bool_param=True), grpc.StatusCode.INVALID_ARGUMENT,
                             TIMEOUT_REFUSED),
    "negative timeout": (_parameter("timeout", int64_param=-5), grpc.StatusCode.INVALID_ARGUMENT,
                         TIMEOUT_REFUSED),
    "signature_name as a number": (_parameter("signature_name", int64_param=1), grpc.StatusCode.INVALID_ARGUMENT,
                                   "the parameter 'signature_name' must be a string"),
    "unknown model": (_raw_request("nothing"), grpc.StatusCode.NOT_FOUND, "Request for unknown model"),
    "wrong datatype": (_raw_request(datatype="FP64"), grpc.StatusCode.INVALID_ARGUMENT,
                       "input 'features' takes datatype FP32; the request sent FP64"),
    "wrong shape": (_raw_request(shape=(1, 3)), grpc.StatusCode.INVALID_ARGUMENT,
                    "input 'features' takes shape [-1, 4]; the request sent [1, 3]"),
    "raw bytes short of the shape": (_raw_request(shape=(2, 4)), grpc.StatusCode.INVALID_ARGUMENT,
                                     "its data holds 16 bytes; its shape and datatype need 32"),
    "raw tensors not one per input": (_raw_request(raw=FOUR_FLOATS_LIST * 2), grpc.StatusCode.INVALID_ARGUMENT,
                                      "raw_input_contents holds 2 tensors; the request has 1 inputs"),
    "too many rows": (_raw_request(shape=(MAX_ROWS + 1, 4)), grpc.StatusCode.INVALID_ARGUMENT,
                      f"at most {MAX_ROWS} rows"),
    "unknown signature": (_raw_request(signature_name="nope"), grpc.StatusCode.FAILED_PRECONDITION,
                          'Serving signature key "nope" not found.'),
}


@pytest.mark.parametrize("case", BAD_GRPC.values(), ids=BAD_GRPC.keys())
def test_grpc_bad_requests_have_clear_codes(served, case):
    request, code, message = case
    with grpc.insecure_channel(served.grpc_target) as channel, pytest.raises(grpc.RpcError) as raised:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert raised.value.code() == code
    assert message in raised.value.details()


def test_grpc_a_version_past_int64_is_invalid_argument_on_every_method(served):
    version = "9" * 5000  # past what int() reads: it was INTERNAL, with a traceback logged per call
    infer_request = _raw_request()
    infer_request.model_version = version
    calls = {"ModelInfer": infer_request,
             "ModelMetadata": service_pb2.ModelMetadataRequest(name="exact", version=version),
             "ModelReady": service_pb2.ModelReadyRequest(name="exact", version=version),
             "ModelStatistics": service_pb2.ModelStatisticsRequest(name="exact", version=version)}
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for method, request in calls.items():
            with pytest.raises(grpc.RpcError) as raised:
                getattr(stub, method)(request, timeout=60)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert raised.value.details().startswith(
                f"failed to get model version from specified version string '{version[:100]}"), method


def test_grpc_timeout_as_uint64_param_is_read_too(served):
    request = _parameter("timeout", uint64_param=300_000)
    request.model_name = "held"
    with grpc.insecure_channel(served.grpc_target) as channel, pytest.raises(grpc.RpcError) as raised:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_grpc_timeout_parameter_caps_the_deadline(grpc_client):
    """As over HTTP: `held` would wait HELD_WINDOW_MS; tritonclient's timeout= (microseconds) ends the call."""
    with pytest.raises(InferenceServerException) as raised:
        grpc_infer(grpc_client, "held", {"features": integer_rows(1)}, timeout=300_000)
    assert raised.value.status() == "StatusCode.DEADLINE_EXCEEDED"


def test_grpc_client_raises_the_servers_error(grpc_client):
    with pytest.raises(InferenceServerException, match="takes datatype FP32; the request sent FP64") as raised:
        grpc_infer(grpc_client, "exact", {"features": np.zeros((1, 4), np.float64)})
    assert raised.value.status() == "StatusCode.INVALID_ARGUMENT"
