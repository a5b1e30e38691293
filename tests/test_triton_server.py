"""Triton's own protocol tests against this server, test by test: qa/L0_http/http_test.py (HttpTest),
qa/L0_grpc/python_unit_test.py (GrpcTest, RestrictedProtocolTest) and
qa/L0_http/http_restricted_api_test.py (RestrictedAPITest).

Each test has the name of its counterpart there, sends the same requests (raw `requests` posts,
tritonclient, the generated stubs) to Triton's qa models, rebuilt with the same tensor names
(scripts/triton_models.py), and asserts what it asserts; some assert a little more. The servers
are the ones Triton's test.sh starts, one per configuration, shared: `explicit` (the explicit
model control server of http_test.py and of GrpcTest) and `restricted` (the restricted API and
restricted protocol servers, in one: this server's REST and gRPC doors run side by side). Where
Triton's test sleeps to let something happen, this one waits for it.

Then the extensions those suites exercise, driven further: raw binary requests, the model
configuration, ModelStreamInfer and the restricted categories. Triton's tests that cannot pass
here, and why, are listed in docs/api-v2.md.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from functools import partial

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as tritonhttpclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor, np_to_triton_dtype

from scripts.triton_models import GRPC_TEST_MODELS, HTTP_TEST_MODELS, L0_HTTP_REPOSITORY
from tests.conftest import Server, wait_for
from tests.triton_models import triton_models, triton_server  # noqa: F401  (a fixture)

TIMEOUT_S = 60
# Ours beside Triton's: identity, a 20 s batch window (a batch runs once 8 rows came), two priority levels.
HELD = {"name": "held", "path": "onnx_zero_1_float32", "max_batch_size": 8, "batch_timeout_ms": 20_000,
        "priority_levels": 2, "default_priority_level": 2}
HELD_BATCH = 8
# The same, for the tests that leave abandoned rows in a forming batch (other tests count held's batches).
HELD_DEADLINE = {**HELD, "name": "held_deadline"}
HELD_CANCEL = {**HELD, "name": "held_cancel"}


@pytest.fixture(scope="module")
def explicit(tmp_path_factory, triton_models) -> Iterator[Server]:  # noqa: F811
    """L0_http's python_unit_test_models server and L0_grpc's grpc_test_models server, in one:
    `--model-control-mode=explicit --load-model=*`, a larger message limit for GrpcTest's 50 MiB."""
    names = (*HTTP_TEST_MODELS, *GRPC_TEST_MODELS)
    with triton_server(triton_models, tmp_path_factory.mktemp("explicit"), repository_names=names, served=names,
                       env={"MODEL_CONTROL_MODE": "explicit", "MAX_REQUEST_BYTES": str(256 << 20)},
                       more=(HELD, HELD_DEADLINE, HELD_CANCEL)) as server:
        yield server


HTTP_RESTRICTED_API = "model-repository:admin-key=admin-value;inference,metadata:infer-key=infer-value"
GRPC_RESTRICTED_PROTOCOL = "model-repository:admin-key=admin-value;inference,health:infer-key=infer-value"


@pytest.fixture(scope="module")
def restricted(tmp_path_factory, triton_models) -> Iterator[Server]:  # noqa: F811
    """L0_http's `--http-restricted-api=model-repository:admin-key=admin-value
    --http-restricted-api=inference,metadata:infer-key=infer-value` server and L0_grpc's
    `--grpc-restricted-protocol=...` one (`inference,health` there), in one."""
    with triton_server(triton_models, tmp_path_factory.mktemp("restricted"), repository_names=L0_HTTP_REPOSITORY,
                       served=("simple",), env={"HTTP_RESTRICTED_API": HTTP_RESTRICTED_API,
                                                "GRPC_RESTRICTED_PROTOCOL": GRPC_RESTRICTED_PROTOCOL,
                                                "LOG_FORMAT": "json"}) as server:
        yield server


def infer_url(server: Server, model_name: str) -> str:
    return f"{server.url}/v2/models/{model_name}/infer"


def http_client(server: Server) -> tritonhttpclient.InferenceServerClient:
    return tritonhttpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=TIMEOUT_S)


# -- qa/L0_http/http_test.py, HttpTest ----------------------------------------------------------


def raw_binary_helper(server: Server, model: str, input_bytes: bytes, expected_output_bytes: bytes,
                      extra_headers: dict[str, str] | None = None) -> requests.Response:
    headers = {"Inference-Header-Content-Length": "0", **(extra_headers or {})}
    r = requests.post(infer_url(server, model), data=input_bytes, headers=headers, timeout=TIMEOUT_S)
    r.raise_for_status()
    header_size = int(r.headers["Inference-Header-Content-Length"])
    assert r.content[header_size:] == expected_output_bytes
    return r


def queued_rows(server: Server, model: str) -> int:
    return requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()["models"][model]["queued_rows"]


def create_nested_json(depth: int, value: str):
    for _ in range(depth):
        value = f"[{value}]"
    return json.loads(value)


def assert_raw_refused(server: Server, model: str, data: bytes, message: str) -> None:
    r = requests.post(infer_url(server, model), data=data, headers={"Inference-Header-Content-Length": "0"},
                      timeout=TIMEOUT_S)
    assert r.status_code == 400
    assert message in r.content.decode()


class TestHttp:
    """qa/L0_http/http_test.py, HttpTest."""

    def test_raw_binary(self, explicit):
        input_bytes = np.arange(8, dtype=np.float32).tobytes()
        answer = raw_binary_helper(explicit, "onnx_zero_1_float32", input_bytes, input_bytes)
        # More than Triton's test: the header is Triton's, and tritonclient reads the answer.
        header_size = int(answer.headers["Inference-Header-Content-Length"])
        assert json.loads(answer.content[:header_size]) == {
            "model_name": "onnx_zero_1_float32", "model_version": "1",
            "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [1, 8],
                         "parameters": {"binary_data_size": 32}}]}
        result = tritonhttpclient.InferResult.from_response_body(answer.content, header_length=header_size)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.arange(8, dtype=np.float32).reshape(1, 8))

    def test_raw_binary_longer(self, explicit):
        input_bytes = np.arange(32, dtype=np.float32).tobytes()
        raw_binary_helper(explicit, "onnx_zero_1_float32", input_bytes, input_bytes)

    def test_byte(self, explicit):
        headers = {"Inference-Header-Content-Length": "0"}
        r = requests.post(infer_url(explicit, "onnx_zero_1_object_1_element"), data="427", headers=headers,
                          timeout=TIMEOUT_S)
        r.raise_for_status()
        header_size = int(r.headers["Inference-Header-Content-Length"])
        # BYTES come back with their 4-byte length first.
        assert r.content[header_size + 4:].decode() == "427"
        assert r.content[header_size:header_size + 4] == (3).to_bytes(4, "little")

    def test_byte_too_many_elements(self, explicit):
        assert_raw_refused(explicit, "onnx_zero_1_object", b"427",
                           "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]")

    def test_multi_variable_dimensions(self, explicit):
        assert_raw_refused(explicit, "onnx_zero_1_float16", np.ones([2, 2], dtype=np.float16).tobytes(),
                           "The shape of the raw input 'INPUT0' can not be deduced because there are more than one "
                           "variable-sized dimension")

    def test_multi_inputs(self, explicit):
        assert_raw_refused(explicit, "onnx_zero_3_float32", np.arange(24, dtype=np.float32).tobytes(),
                           "Raw request must only have 1 input (found 1) to be deduced but got 3 inputs in")

    def test_content_encoding_unsupported_client(self, explicit):
        for encoding in ["chunked", "compress", "deflate", "gzip"]:
            np_input = np.arange(8, dtype=np.float32).reshape(1, -1)
            inputs = [tritonhttpclient.InferInput("INPUT0", np_input.shape, np_to_triton_dtype(np_input.dtype))]
            inputs[0].set_data_from_numpy(np_input)
            with http_client(explicit) as client, \
                    pytest.raises(InferenceServerException, match="Unsupported HTTP header"):
                client.infer(model_name="onnx_zero_1_float32", inputs=inputs, headers={"Transfer-Encoding": encoding})

    def test_descriptive_status_code(self, explicit):
        model = "onnx_zero_1_float32_queue"
        input_bytes = np.arange(8, dtype=np.float32).tobytes()
        first: list[requests.Response] = []
        thread = threading.Thread(target=lambda: first.append(raw_binary_helper(explicit, model, input_bytes,
                                                                                 input_bytes)))
        thread.start()
        # Triton's test sleeps 0.5 s; here, until the first request waits in the model's 1 s window.
        wait_for(lambda: queued_rows(explicit, model) == 1, within_s=TIMEOUT_S, what="the first request queued")
        with pytest.raises(requests.exceptions.HTTPError) as context:
            raw_binary_helper(explicit, model, input_bytes, input_bytes)
        assert context.value.response.status_code == 503
        thread.join()
        assert first and first[0].status_code == 200

    def test_buffer_size_overflow(self, explicit):
        def payload(rows: int) -> dict:
            return {"inputs": [{"name": "INPUT0", "shape": [rows, 2**60 + 2], "datatype": "FP32", "data": [1.0]}]}

        headers = {"Content-Type": "application/json"}
        r1 = requests.post(infer_url(explicit, "onnx_zero_1_float32"), json=payload(2**4), headers=headers,
                           timeout=TIMEOUT_S)
        assert r1.status_code == 400
        assert "causes total element count to exceed maximum size of" in r1.content.decode()
        r2 = requests.post(infer_url(explicit, "onnx_zero_1_float32"), json=payload(2**2), headers=headers,
                           timeout=TIMEOUT_S)
        assert r2.status_code == 400
        assert "byte size overflow for input" in r2.content.decode()
        # More than Triton's test: its whole words.
        assert r1.json()["error"] == ("invalid shape for input 'INPUT0': shape [16,1152921504606846978] causes total "
                                      "element count to exceed maximum size of 9223372036854775807")
        assert r2.json()["error"] == ("byte size overflow for input 'INPUT0': element count (4611686018427387912) * "
                                      "data type size (4) exceeds maximum allowed size (9223372036854775807)")

    @pytest.mark.parametrize("dtype, data, model, json_depth, should_succeed", [
        ("BYTES", '"hello"', "simple_identity", 120, False),
        ("BYTES", '"hello"', "simple_identity", 50, True),
        ("INT64", "123", "simple_identity_int64", 120, False),
        ("INT64", "123", "simple_identity_int64", 50, True),
        # More than Triton's test: Triton's edge (a value under 99 arrays passes, under 100 does not),
        # and FP32, which the server reads by another path.
        ("INT64", "123", "simple_identity_int64", 99, True),
        ("INT64", "123", "simple_identity_int64", 100, False),
        ("FP32", "1.5", "onnx_zero_1_float32", 99, True),
        ("FP32", "1.5", "onnx_zero_1_float32", 100, False),
    ])
    def test_json_recursion_depth_limit(self, explicit, dtype, data, model, json_depth, should_succeed):
        payload = {"inputs": [{"name": "INPUT0", "datatype": dtype, "shape": [1, 1],
                               "data": create_nested_json(json_depth, data)}]}
        response = requests.post(infer_url(explicit, model), headers={"Content-Type": "application/json"},
                                 json=payload, timeout=TIMEOUT_S)
        if should_succeed:
            assert response.status_code == 200
            assert response.json()["outputs"][0]["data"] == [json.loads(data)]
        else:
            assert response.status_code != 200
            assert "JSON nesting depth exceeds maximum allowed limit (100)" in response.json().get("error", "")

    def test_duplicate_output_names(self, explicit):
        input_data = np.arange(8, dtype=np.float32).flatten().tolist()
        payload = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 8], "data": [input_data]}],
                   "outputs": [{"name": "OUTPUT0"} for _ in range(2)]}
        r = requests.post(infer_url(explicit, "onnx_zero_1_float32"), json=payload,
                          headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
        assert r.status_code == 400
        assert "output 'OUTPUT0' already exists in request" in r.json().get("error", "")
        assert requests.get(explicit.url + "/v2/health/live", timeout=TIMEOUT_S).status_code == 200

    def test_repository_index_deeply_nested_json(self, explicit):
        depth = 250000
        payload = '{"ready":' + ("[" * depth) + "true" + ("]" * depth) + "}"
        assert len(payload) < 64 * 1024 * 1024
        response = requests.post(explicit.url + "/v2/repository/index", data=payload,
                                 headers={"Content-Type": "application/json"}, timeout=TIMEOUT_S)
        assert response.status_code == 400
        assert "Invalid value for 'ready': expected a boolean" in response.json()["error"]
        assert requests.get(explicit.url + "/v2/health/live", timeout=10).status_code == 200

    def test_inference_header_content_length_out_of_range(self, explicit):
        r = requests.post(infer_url(explicit, "onnx_zero_1_float32"), json={"inputs": []},
                          headers={"Inference-Header-Content-Length": "99999999999"}, timeout=TIMEOUT_S)
        assert r.status_code == 400
        assert requests.get(explicit.url + "/v2/health/live", timeout=TIMEOUT_S).status_code == 200


# -- qa/L0_grpc/python_unit_test.py, GrpcTest ---------------------------------------------------


def simple_inputs(module=grpcclient) -> list:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(np.ones(shape=(1, 16), dtype=np.int32))
    inputs[1].set_data_from_numpy(np.ones(shape=(1, 16), dtype=np.int32))
    return inputs


class TestGrpc:
    """qa/L0_grpc/python_unit_test.py, GrpcTest."""

    def test_duplicate_output_names_rejected(self, explicit):
        client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0") for _ in range(2)]
        with pytest.raises(InferenceServerException) as ctx:
            client.infer(model_name="simple", inputs=simple_inputs(), outputs=outputs)
        assert "output 'OUTPUT0' already exists in request" in str(ctx.value)
        assert client.is_server_live()

    def test_bytes_contents_many_elements_serialization(self, explicit):
        element_count = 10 * 1024 * 1024
        payload = b"A"
        request = service_pb2.ModelInferRequest(model_name="string_identity")
        input_tensor = request.inputs.add(name="INPUT0", datatype="BYTES", shape=[element_count])
        input_tensor.contents.bytes_contents.extend([payload] * element_count)
        request.outputs.add().name = "OUTPUT0"
        options = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]
        with grpc.insecure_channel(explicit.grpc_target, options=options) as channel:
            response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=120)
        assert list(response.outputs[0].shape) == [element_count]
        assert len(response.raw_output_contents[0]) == element_count * (4 + len(payload))
        output = deserialize_bytes_tensor(response.raw_output_contents[0])
        assert output.shape == (element_count,)
        assert np.all(output == payload)
        client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
        assert client.is_server_live()
        assert client.is_model_ready("string_identity")


# -- qa/L0_grpc/python_unit_test.py, RestrictedProtocolTest --------------------------------------

PREFIX = "triton-grpc-protocol-"


@pytest.fixture
def grpc_restricted(restricted) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(url=restricted.grpc_target)
    yield client
    client.close()


def callback(completed: queue.Queue, result, error) -> None:
    completed.put(error if error else result)


class TestRestrictedProtocol:
    """qa/L0_grpc/python_unit_test.py, RestrictedProtocolTest."""

    def test_sanity(self, grpc_restricted):
        for headers in (None, {PREFIX + "infer-key": "infer-value"}):
            assert grpc_restricted.get_inference_statistics("simple", headers=headers).model_stats[0].name == "simple"

    def test_model_repository(self, grpc_restricted):
        with pytest.raises(InferenceServerException, match="This protocol is restricted"):
            grpc_restricted.unload_model("simple", headers={PREFIX + "infer-key": "infer-value"})
        with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
            grpc_restricted.unload_model("simple", headers={PREFIX + "admin-key": "admin-value"})

    def test_health(self, grpc_restricted):
        with pytest.raises(InferenceServerException, match="This protocol is restricted") as refused:
            grpc_restricted.is_server_live()
        assert grpc_restricted.is_server_live({PREFIX + "infer-key": "infer-value"})
        # More than Triton's test: its status and its whole words.
        assert (refused.value.status(), refused.value.message()) == (
            "StatusCode.UNAVAILABLE", "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'")

    def test_infer(self, grpc_restricted):
        with pytest.raises(InferenceServerException, match="This protocol is restricted"):
            grpc_restricted.infer(model_name="simple", inputs=simple_inputs(), headers={"test": "1"})
        result = grpc_restricted.infer(model_name="simple", inputs=simple_inputs(),
                                       headers={PREFIX + "infer-key": "infer-value"})
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2, np.int32))

    def test_stream_infer(self, grpc_restricted):
        completed: queue.Queue = queue.Queue()
        grpc_restricted.start_stream(partial(callback, completed), headers={"test": "1"})
        # Triton's test sleeps 1 s for the refusal to come back; here, until it has.
        error = completed.get(timeout=TIMEOUT_S)
        with pytest.raises(InferenceServerException, match="The stream is no longer in valid state"):
            grpc_restricted.async_stream_infer(model_name="simple", inputs=simple_inputs())
        assert isinstance(error, InferenceServerException)
        assert "This protocol is restricted" in error.message()
        assert completed.empty()
        grpc_restricted.stop_stream()
        grpc_restricted.start_stream(partial(callback, completed), headers={PREFIX + "infer-key": "infer-value"})
        grpc_restricted.async_stream_infer(model_name="simple", inputs=simple_inputs())
        result = completed.get(timeout=TIMEOUT_S)
        assert not isinstance(result, InferenceServerException)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((1, 16), 2, np.int32))
        grpc_restricted.stop_stream()


class TestRestrictedApi:
    """qa/L0_http/http_restricted_api_test.py, RestrictedAPITest."""

    def test_sanity(self, restricted):
        with http_client(restricted) as client:
            for headers in (None, {"infer-key": "infer-value"}):
                assert client.get_inference_statistics("simple", headers=headers)["model_stats"][0]["name"] == "simple"

    def test_model_repository(self, restricted):
        with http_client(restricted) as client:
            with pytest.raises(InferenceServerException, match="This API is restricted"):
                client.unload_model("simple", headers={"infer-key": "infer-value"})
            with pytest.raises(InferenceServerException, match="explicit model load / unload is not allowed"):
                client.unload_model("simple", headers={"admin-key": "admin-value"})

    def test_metadata(self, restricted):
        with http_client(restricted) as client:
            with pytest.raises(InferenceServerException, match="This API is restricted"):
                client.get_server_metadata()
            assert client.get_server_metadata({"infer-key": "infer-value"})["extensions"]

    def test_infer(self, restricted):
        with http_client(restricted) as client:
            with pytest.raises(InferenceServerException, match="This API is restricted"):
                client.infer(model_name="simple", inputs=simple_inputs(tritonhttpclient), headers={"test": "1"})
            result = client.infer(model_name="simple", inputs=simple_inputs(tritonhttpclient),
                                  headers={"infer-key": "infer-value"})
            np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), np.zeros((1, 16), np.int32))


# -- beyond Triton's suites: each restricted category on both doors ------------------------------

REST_CATEGORIES = [
    # (method, path, restricted by the server's REST groups, header that opens it)
    ("GET", "/v2", "infer-key"),
    ("GET", "/v2/models/simple", "infer-key"),
    ("POST", "/v2/models/simple/infer", "infer-key"),
    ("POST", "/v2/repository/index", "admin-key"),
    ("GET", "/v2/health/ready", None),
    ("GET", "/v2/models/simple/config", None),
    ("GET", "/v2/models/simple/stats", None),
]


@pytest.mark.parametrize("method, path, key", REST_CATEGORIES)
def test_rest_routes_answer_403_in_tritons_words_without_their_categorys_header(restricted, method, path, key):
    body = {"inputs": [{"name": f"INPUT{i}", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}
                       for i in range(2)]} if path.endswith("infer") else {}
    send = partial(requests.request, method, restricted.url + path, timeout=TIMEOUT_S,
                   data=json.dumps(body) if method == "POST" else None)
    wrong = {"infer-key": "wrong", "admin-key": "wrong"}
    if key is None:
        assert send().status_code == 200
        return
    for headers in ({}, wrong, {key: "infer-value" if key == "admin-key" else "admin-value"}):
        answer = send(headers=headers)
        assert (answer.status_code, answer.json()) == (403, {"error": f"This API is restricted, expecting header "
                                                                      f"'{key}'"})
    assert send(headers={key: key.replace("key", "value")}).status_code == 200


def test_grpc_methods_answer_unavailable_without_their_categorys_metadata(restricted):
    with grpc.insecure_channel(restricted.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        calls = {
            "ServerLive": (stub.ServerLive, service_pb2.ServerLiveRequest(), "infer-key"),
            "ModelReady": (stub.ModelReady, service_pb2.ModelReadyRequest(name="simple"), "infer-key"),
            "RepositoryIndex": (stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(), "admin-key"),
            "ServerMetadata": (stub.ServerMetadata, service_pb2.ServerMetadataRequest(), None),
            "ModelConfig": (stub.ModelConfig, service_pb2.ModelConfigRequest(name="simple"), None),
        }
        for name, (call, request, key) in calls.items():
            if key is None:
                call(request, timeout=TIMEOUT_S)
                continue
            for metadata in ((), ((key, key.replace("key", "value")),), ((PREFIX + key, "wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=TIMEOUT_S, metadata=metadata)
                assert (refused.value.code(), refused.value.details()) == (
                    grpc.StatusCode.UNAVAILABLE, f"This protocol is restricted, expecting header '{PREFIX}{key}'"), name
            call(request, timeout=TIMEOUT_S, metadata=((PREFIX + key, key.replace("key", "value")),))
    warnings = [json.loads(line) for line in restricted.log().splitlines()
                if line.startswith("{") and '"app.wire.restricted"' in line]
    assert "refused /inference.GRPCInferenceService/RepositoryIndex: no valid 'triton-grpc-protocol-admin-key' " \
           "header" in {entry["message"] for entry in warnings}
    assert "admin-value" not in restricted.log() and "wrong" not in restricted.log()


# -- beyond Triton's suites: raw binary requests, batched as any other ---------------------------


def stats(server: Server, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of the model's statistics."""
    with http_client(server) as client:
        model_stats = client.get_inference_statistics(model)["model_stats"][0]
    return model_stats["inference_count"], model_stats["execution_count"]


def test_raw_requests_batch_with_json_requests_and_are_refused_past_the_row_limit(explicit):
    before = stats(explicit, "held")
    rows = [np.arange(3, dtype=np.float32) + row for row in range(HELD_BATCH)]
    answers: dict[int, object] = {}

    def raw(row: int) -> None:
        answers[row] = raw_binary_helper(explicit, "held", rows[row].tobytes(), rows[row].tobytes())

    def json_infer(row: int) -> None:
        tensor = tritonhttpclient.InferInput("INPUT0", [1, 3], "FP32")
        tensor.set_data_from_numpy(rows[row].reshape(1, 3), binary_data=False)
        with http_client(explicit) as client:
            answers[row] = client.infer("held", [tensor]).as_numpy("OUTPUT0")

    threads = [threading.Thread(target=raw if row % 2 else json_infer, args=(row,)) for row in range(HELD_BATCH)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Eight requests of one row, half raw, half JSON: one predict call of the held window's 8 rows.
    assert stats(explicit, "held") == (before[0] + HELD_BATCH, before[1] + 1)
    for row in range(0, HELD_BATCH, 2):
        np.testing.assert_array_equal(answers[row], rows[row].reshape(1, 3))
    # Raw data that does not divide into the deduced shape is refused, as Triton refuses it.
    r = requests.post(infer_url(explicit, "onnx_zero_1_float32"), data=b"\x00" * 6,
                      headers={"Inference-Header-Content-Length": "0"}, timeout=TIMEOUT_S)
    assert (r.status_code, r.json()) == (400, {"error": "input 'INPUT0': its data holds 6 bytes; its shape and "
                                                        "datatype need 4"})


# -- beyond Triton's suites: the model configuration ---------------------------------------------


def test_model_config_answers_tritons_fields_on_both_doors(explicit):
    with http_client(explicit) as client:
        config = client.get_model_config("held")
        with pytest.raises(InferenceServerException) as unknown:
            client.get_model_config("nothing")
    assert {key: config[key] for key in ("name", "platform", "backend", "max_batch_size", "version_policy")} == {
        "name": "held", "platform": "tensorflow_savedmodel", "backend": "tensorflow", "max_batch_size": 8,
        "version_policy": {"latest": {"num_versions": 1}}}
    assert [(tensor["name"], tensor["data_type"], tensor["dims"]) for tensor in config["input"] + config["output"]] \
        == [("INPUT0", "TYPE_FP32", [-1]), ("OUTPUT0", "TYPE_FP32", [-1])]
    batching = config["dynamic_batching"]
    assert (batching["preferred_batch_size"], batching["max_queue_delay_microseconds"], batching["priority_levels"],
            batching["default_priority_level"], batching["default_queue_policy"]["max_queue_size"]) == (
        [1, 2, 4, 8], 20_000_000, 2, 2, 128)
    # Every field written, as Triton writes them: defaults included, 64-bit numbers as numbers.
    assert config["instance_group"] == [] and config["input"][0]["format"] == "FORMAT_NONE"
    assert (unknown.value.status(), unknown.value.message()) == (
        "404", "Request for unknown model: 'nothing' is not found")
    client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
    answer = client.get_model_config("held")
    assert answer.config.max_batch_size == 8
    assert json_format.MessageToDict(answer.config, preserving_proto_field_name=True) == json_format.MessageToDict(
        json_format.ParseDict(config, type(answer.config)()), preserving_proto_field_name=True)
    assert client.get_model_config("string_identity").config.max_batch_size == 1 << 20


# -- beyond Triton's suites: ModelStreamInfer ----------------------------------------------------


def held_request(row: float, request_id: str, model: str = "held", **parameters) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 1])
    request.raw_input_contents.append(np.float32([row]).tobytes())
    for key, value in parameters.items():
        request.parameters[key].int64_param = value
    return request


def simple_request(value: int, request_id: str, outputs: tuple[str, ...] = ()) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="simple", id=request_id)
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.full(16, value, np.int32).tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    return request


def fill_held(server: Server, rows: int, model: str = "held") -> None:
    """`rows` unary calls of one row each to `model`, at once: with the rows already queued, a batch."""
    client = grpcclient.InferenceServerClient(url=server.grpc_target)
    done: queue.Queue = queue.Queue()
    for row in range(rows):
        tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
        tensor.set_data_from_numpy(np.float32([[100 + row]]))
        client.async_infer(model, [tensor], partial(callback, done), client_timeout=TIMEOUT_S)
    for _ in range(rows):
        assert not isinstance(done.get(timeout=TIMEOUT_S), InferenceServerException)
    client.close()


def stream_messages(server: Server, requests_: list, metadata=()) -> list:
    """Every message of one ModelStreamInfer call that sends `requests_`, then half-closes."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return list(stub.ModelStreamInfer(iter(requests_), timeout=TIMEOUT_S, metadata=metadata))


def test_stream_answers_in_request_order_each_with_its_id(explicit):
    completed: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
    client.start_stream(partial(callback, completed))
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.float32([[7]]))
    # The first waits in held's window; the second, to simple, is answered at once, but written after it.
    client.async_stream_infer("held", [tensor], request_id="first")
    client.async_stream_infer("simple", simple_inputs(), request_id="second")
    wait_for(lambda: queued_rows(explicit, "held") == 1, within_s=TIMEOUT_S, what="the first request queued")
    assert completed.empty()
    fill_held(explicit, HELD_BATCH - 1)
    first, second = completed.get(timeout=TIMEOUT_S), completed.get(timeout=TIMEOUT_S)
    client.stop_stream()
    assert [first.get_response().id, second.get_response().id] == ["first", "second"]
    np.testing.assert_array_equal(first.as_numpy("OUTPUT0"), np.float32([[7]]))
    np.testing.assert_array_equal(second.as_numpy("OUTPUT1"), np.zeros((1, 16), np.int32))
    assert second.get_response().parameters["triton_final_response"].bool_param


def test_stream_requests_batch_with_each_other_and_with_unary_calls(explicit):
    before = stats(explicit, "held")
    streamed = HELD_BATCH - 2
    with grpc.insecure_channel(explicit.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        outgoing: queue.Queue = queue.Queue()
        for row in range(streamed):
            outgoing.put(held_request(row, f"r{row}"))
        answers = stub.ModelStreamInfer(iter(outgoing.get, None), timeout=TIMEOUT_S)
        # Read one at a time, these would each wait out the 20 s window: all six are queued at once.
        wait_for(lambda: queued_rows(explicit, "held") == streamed, within_s=TIMEOUT_S, what="six rows queued")
        fill_held(explicit, HELD_BATCH - streamed)
        outgoing.put(None)
        messages = list(answers)
    assert [(m.error_message, m.infer_response.id) for m in messages] == [("", f"r{row}") for row in range(streamed)]
    assert [np.frombuffer(m.infer_response.raw_output_contents[0], np.float32).tolist() for m in messages] == [
        [row] for row in range(streamed)]
    assert stats(explicit, "held") == (before[0] + HELD_BATCH, before[1] + 1)


def test_a_streamed_failure_is_answered_in_the_stream_which_goes_on(explicit):
    unknown = simple_request(1, "a")
    unknown.model_name = "nothing"
    # A streamed request's parameters are read as a unary call's: its priority too.
    priority = simple_request(5, "f")
    priority.parameters["priority"].string_param = "high"
    messages = stream_messages(explicit, [unknown, simple_request(2, "b"),
                                          simple_request(3, "c", outputs=("OUTPUT0", "OUTPUT0")),
                                          held_request(1, "d", timeout=-1), simple_request(4, "e"), priority])
    assert [(m.error_message, m.infer_response.id) for m in messages] == [
        ("Request for unknown model: 'nothing' is not found", "a"), ("", "b"),
        ("output 'OUTPUT0' already exists in request", "c"),
        ("the parameter 'timeout' is microseconds, a whole number of 0 or more", "d"), ("", "e"),
        ("the parameter 'priority' must be a whole number from 0 to 18446744073709551615 (1 is the highest level)",
         "f")]
    assert np.frombuffer(messages[4].infer_response.raw_output_contents[0], np.int32).tolist() == [8] * 16


def test_triton_grpc_error_ends_the_stream_with_the_failures_status(explicit):
    unknown = simple_request(1, "b")
    unknown.model_name = "nothing"
    received = []
    with pytest.raises(grpc.RpcError) as ended:
        with grpc.insecure_channel(explicit.grpc_target) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            for message in stub.ModelStreamInfer(iter([simple_request(1, "a"), unknown, simple_request(2, "c")]),
                                                 timeout=TIMEOUT_S, metadata=(("triton_grpc_error", "true"),)):
                received.append(message.infer_response.id)
    assert received == ["a"]
    assert (ended.value.code(), ended.value.details()) == (
        grpc.StatusCode.NOT_FOUND, "Request for unknown model: 'nothing' is not found")


def test_a_streamed_requests_deadline_is_its_timeout_or_the_streams(explicit):
    # A 20 s window: its own timeout of 0.3 s ends the first request; the stream goes on.
    messages = stream_messages(explicit, [held_request(1, "a", "held_deadline", timeout=300_000),
                                          simple_request(1, "b")])
    assert [(m.error_message, m.infer_response.id) for m in messages] == [
        ("no result from model 'held_deadline' within 300 ms", "a"), ("", "b")]
    # The stream's own deadline ends the stream, and the request it holds.
    route = "/inference.GRPCInferenceService/ModelStreamInfer"
    expired = explicit.metric("model_server_requests_total", route=route, status="DEADLINE_EXCEEDED")
    completed: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.float32([[1]]))
    client.start_stream(partial(callback, completed), stream_timeout=0.5)
    client.async_stream_infer("held_deadline", [tensor], request_id="x")
    error = completed.get(timeout=TIMEOUT_S)
    client.stop_stream()
    # The request's deadline is the stream's: its in-stream answer and the stream's end race to the client.
    assert isinstance(error, InferenceServerException) and (
        error.status() == "StatusCode.DEADLINE_EXCEEDED"
        or (error.status() is None and error.message().startswith("no result from model 'held_deadline' within")))
    wait_for(lambda: explicit.metric("model_server_requests_total", route=route,
                                     status="DEADLINE_EXCEEDED") == expired + 1,
             within_s=TIMEOUT_S, what="the streamed request recorded DEADLINE_EXCEEDED")


def test_a_cancelled_stream_cancels_its_requests_before_they_run(explicit):
    completed: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=explicit.grpc_target)
    client.start_stream(partial(callback, completed))
    tensor = grpcclient.InferInput("INPUT0", [1, 1], "FP32")
    tensor.set_data_from_numpy(np.float32([[1]]))
    client.async_stream_infer("held_cancel", [tensor], request_id="gone")
    wait_for(lambda: queued_rows(explicit, "held_cancel") == 1, within_s=TIMEOUT_S, what="the streamed row queued")
    client.stop_stream(cancel_requests=True)
    route = "/inference.GRPCInferenceService/ModelStreamInfer"
    wait_for(lambda: explicit.metric("model_server_requests_total", route=route, status="CANCELLED") >= 1,
             within_s=TIMEOUT_S, what="the streamed request recorded CANCELLED")
    # Seven more rows fill the batch it waits in: it runs without the cancelled one.
    fill_held(explicit, HELD_BATCH - 1, "held_cancel")
    assert stats(explicit, "held_cancel") == (HELD_BATCH - 1, 1)
    assert explicit.metric("model_server_rejections_total", model="held_cancel", reason="client_gone") == 1


def test_a_streamed_request_takes_a_place_in_the_call_limit_until_its_answer_is_written(in_process_app,
                                                                                      exact_model_path):
    """In this process, a gRPC server of one place (THREADS=1): the first request holds it in its
    2 s batch window, so the second, read meanwhile, is refused at once, in the stream; the third,
    sent once the first was answered, gets the place back."""
    from app.grpc import server as grpc_server
    from app.grpc.calls import CONCURRENCY_EXCEEDED
    from tests.conftest import free_port, integer_rows

    app = in_process_app(model_path=str(exact_model_path), batch_timeout_ms=2000, max_batch_size=8)
    target = f"127.0.0.1:{free_port()}"

    def features(request_id: str) -> service_pb2.ModelInferRequest:
        request = service_pb2.ModelInferRequest(model_name="default", id=request_id)
        request.inputs.add(name="features", datatype="FP32", shape=[1, 4])
        request.raw_input_contents.append(integer_rows(1).tobytes())
        return request

    outgoing: queue.Queue = queue.Queue()
    for request_id in ("a", "b"):
        outgoing.put(features(request_id))
    with grpc_server.serving(app.services, bind=target, threads=1), grpc.insecure_channel(target) as channel:
        answers = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter(outgoing.get, None),
                                                                                      timeout=TIMEOUT_S)
        first, second = next(answers), next(answers)
        app.services.registry.flush(later_too=True)  # the third's batch goes without its window
        outgoing.put(features("c"))
        outgoing.put(None)
        third = next(answers)
    assert [(m.error_message, m.infer_response.id) for m in (first, second, third)] == [
        ("", "a"), (CONCURRENCY_EXCEEDED, "b"), ("", "c")]
