"""Triton's client tests against this server, test by test: qa/L0_http/python_http_aio_test.py
(TestHttpAioClient), qa/L0_grpc/python_grpc_aio_test.py (TestGrpcAioClient), the client examples
their test.sh scripts run, and L0_http's test.sh curl checks.

Each test has the name of its counterpart (an example's: its file's), sends the same requests
with tritonclient to Triton's qa models, rebuilt with the same tensor names
(scripts/triton_models.py), and asserts what it asserts; an example's `sys.exit(1)` is a failed
assert here. The servers are the first ones each test.sh starts, shared: `l0_http` (its
repository of 7 models, control mode none) and `l0_grpc` (8). The tests that cannot pass here,
and why, are listed in docs/api-v2.md.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Iterator
from functools import partial

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient import utils
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from scripts.triton_models import L0_GRPC_REPOSITORY, L0_HTTP_REPOSITORY
from tests.conftest import Server
from tests.triton_models import triton_models, triton_server  # noqa: F401  (a fixture)

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def l0_http(tmp_path_factory, triton_models) -> Iterator[Server]:  # noqa: F811
    """L0_http's first server: `--model-repository=models` (7 models), control mode none."""
    with triton_server(triton_models, tmp_path_factory.mktemp("l0_http"), repository_names=L0_HTTP_REPOSITORY,
                       served=("simple", "simple_identity", "simple_string")) as server:
        yield server


@pytest.fixture(scope="module")
def l0_grpc(tmp_path_factory, triton_models) -> Iterator[Server]:  # noqa: F811
    """L0_grpc's first server: its repository of 8 models, simple_int8 too."""
    with triton_server(triton_models, tmp_path_factory.mktemp("l0_grpc"), repository_names=L0_GRPC_REPOSITORY,
                       served=("simple", "simple_identity", "simple_string", "simple_int8")) as server:
        yield server


def url(server: Server) -> str:
    return server.url.removeprefix("http://")


# -- qa/L0_http/python_http_aio_test.py ----------------------------------------------------------


class TestHttpAioClient:
    """Each test runs its coroutine with a fresh tritonclient.http.aio client, closed after."""

    @staticmethod
    def run(server: Server, body):
        async def session():
            client = httpclient_aio.InferenceServerClient(url=url(server))
            try:
                return await body(client)
            finally:
                await client.close()

        return asyncio.run(session())

    def test_is_server_live(self, l0_http):
        assert self.run(l0_http, lambda client: client.is_server_live()) is True

    def test_is_server_ready(self, l0_http):
        assert self.run(l0_http, lambda client: client.is_server_ready()) is True

    def test_is_model_ready(self, l0_http):
        assert self.run(l0_http, lambda client: client.is_model_ready("simple")) is True

    def test_get_model_metadata(self, l0_http):
        assert self.run(l0_http, lambda client: client.get_model_metadata("simple"))["name"] == "simple"

    def test_get_model_config(self, l0_http):
        assert self.run(l0_http, lambda client: client.get_model_config("simple"))["name"] == "simple"

    def test_get_model_repository_index(self, l0_http):
        assert len(self.run(l0_http, lambda client: client.get_model_repository_index())) == 7

    def test_load_model(self, l0_http):
        with pytest.raises(InferenceServerException,
                           match="explicit model load / unload is not allowed if polling is enabled"):
            self.run(l0_http, lambda client: client.load_model("simple"))

    def test_unload_model(self, l0_http):
        # Triton's calls load_model here, a copy of test_load_model; the unload is what its name asks.
        with pytest.raises(InferenceServerException,
                           match="explicit model load / unload is not allowed if polling is enabled"):
            self.run(l0_http, lambda client: client.unload_model("simple"))

    def test_get_inference_statistics(self, l0_http):
        assert self.run(l0_http, lambda client: client.get_inference_statistics())["model_stats"]


# -- qa/L0_grpc/python_grpc_aio_test.py ----------------------------------------------------------


class TestGrpcAioClient:
    """Each test runs its coroutine with a fresh tritonclient.grpc.aio client, closed after."""

    REFUSED = r"\[StatusCode\.UNAVAILABLE\] explicit model load / unload is not allowed if polling is enabled"

    @staticmethod
    def run(server: Server, body):
        async def session():
            client = grpcclient_aio.InferenceServerClient(url=server.grpc_target)
            try:
                return await body(client)
            finally:
                await client.close()

        return asyncio.run(session())

    def test_is_server_live(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.is_server_live()) is True

    def test_is_server_ready(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.is_server_ready()) is True

    def test_is_model_ready(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.is_model_ready("simple")) is True

    def test_get_model_metadata(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.get_model_metadata("simple")).name == "simple"

    def test_get_model_config(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.get_model_config("simple")).config.name == "simple"

    def test_get_model_repository_index(self, l0_grpc):
        assert len(self.run(l0_grpc, lambda client: client.get_model_repository_index()).models) == 8

    def test_load_model(self, l0_grpc):
        with pytest.raises(InferenceServerException, match=self.REFUSED):
            self.run(l0_grpc, lambda client: client.load_model("simple"))

    def test_unload_model(self, l0_grpc):
        # Triton's calls load_model here, a copy of test_load_model; the unload is what its name asks.
        with pytest.raises(InferenceServerException, match=self.REFUSED):
            self.run(l0_grpc, lambda client: client.unload_model("simple"))

    def test_get_inference_statistics(self, l0_grpc):
        assert self.run(l0_grpc, lambda client: client.get_inference_statistics()).model_stats


# -- the client examples L0_http's test.sh runs ----------------------------------------------------

INPUT0 = np.arange(start=0, stop=16, dtype=np.int32).reshape(1, 16)


def validate_result(results, input0_data: np.ndarray, input1_data: np.ndarray) -> None:
    np.testing.assert_array_equal(results.as_numpy("OUTPUT0"), input0_data + input1_data)
    np.testing.assert_array_equal(results.as_numpy("OUTPUT1"), input0_data - input1_data)


def http_inputs(module, input0_data: np.ndarray, input1_data: np.ndarray) -> list:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(input0_data, binary_data=False)
    inputs[1].set_data_from_numpy(input1_data, binary_data=True)
    return inputs


def http_outputs(module) -> list:
    return [module.InferRequestedOutput("OUTPUT0", binary_data=True),
            module.InferRequestedOutput("OUTPUT1", binary_data=False)]


QUERY_PARAMS = {"test_1": 1, "test_2": 2}


def test_simple_http_health_metadata(l0_http):
    client = httpclient.InferenceServerClient(url=url(l0_http))
    assert client.is_server_live(query_params=QUERY_PARAMS)
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.get_server_metadata()["name"] == "tensorflow-model-server"  # Triton's: "triton"
    assert client.get_model_metadata("simple", query_params=QUERY_PARAMS)["name"] == "simple"
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in unknown.value.message()


def test_simple_http_infer_client(l0_http):
    client = httpclient.InferenceServerClient(url=url(l0_http))
    input1_data = np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)
    results = client.infer("simple", http_inputs(httpclient, INPUT0, input1_data), outputs=http_outputs(httpclient),
                           query_params=QUERY_PARAMS)
    assert len(client.get_inference_statistics(model_name="simple")["model_stats"]) == 1
    validate_result(results, INPUT0, input1_data)
    results = client.infer("simple", http_inputs(httpclient, INPUT0, input1_data), outputs=None,
                           query_params=QUERY_PARAMS)
    validate_result(results, INPUT0, input1_data)
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("wrong_model_name", http_inputs(httpclient, INPUT0, input1_data),
                     outputs=http_outputs(httpclient), query_params=QUERY_PARAMS)
    assert unknown.value.message().startswith("Request for unknown model")


def test_simple_http_infer_client_with_a_base_path(l0_http):
    """`simple_http_infer_client.py -u localhost:8000/base_path`: fails, having posted there."""
    client = httpclient.InferenceServerClient(url=url(l0_http) + "/base_path")
    with pytest.raises(InferenceServerException) as failed:
        client.infer("simple", http_inputs(httpclient, INPUT0, INPUT0), outputs=http_outputs(httpclient))
    assert failed.value.status() == "404"


def test_simple_http_aio_infer_client(l0_http):
    input1_data = np.full(shape=(1, 16), fill_value=-1, dtype=np.int32)

    async def main():
        client = httpclient_aio.InferenceServerClient(url=url(l0_http))

        def infer(model_name: str, outputs):
            return client.infer(model_name, http_inputs(httpclient_aio, INPUT0, input1_data), outputs=outputs,
                                query_params=QUERY_PARAMS)

        try:
            results = await infer("simple", http_outputs(httpclient_aio))
            statistics = await client.get_inference_statistics(model_name="simple")
            assert len(statistics["model_stats"]) == 1
            validate_result(results, INPUT0, input1_data)
            validate_result(await infer("simple", None), INPUT0, input1_data)
            with pytest.raises(InferenceServerException) as unknown:
                await infer("wrong_model_name", http_outputs(httpclient_aio))
            assert unknown.value.message().startswith("Request for unknown model")
            for result in await asyncio.gather(infer("simple", http_outputs(httpclient_aio)), infer("simple", None)):
                validate_result(result, INPUT0, input1_data)
        finally:
            await client.close()

    asyncio.run(main())


def test_simple_http_async_infer_client(l0_http):
    client = httpclient.InferenceServerClient(url=url(l0_http), concurrency=2)
    input1_data = np.ones(shape=(1, 16), dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(INPUT0, binary_data=True)
    inputs[1].set_data_from_numpy(input1_data, binary_data=True)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    async_requests = [client.async_infer(model_name="simple", inputs=inputs, outputs=outputs) for _ in range(2)]
    for async_request in async_requests:
        validate_result(async_request.get_result(), INPUT0, input1_data)


def string_inference(module, client) -> None:
    """simple_string_inference of the string examples (HTTP and gRPC)."""
    in0, in1 = INPUT0, np.ones(shape=(1, 16), dtype=np.int32)
    input0_data = np.array([str(x).encode("utf-8") for x in in0.reshape(in0.size)], dtype=np.object_).reshape(1, 16)
    input1_data = np.array([str(x).encode("utf-8") for x in in1.reshape(in1.size)], dtype=np.object_).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "BYTES"), module.InferInput("INPUT1", [1, 16], "BYTES")]
    if module is httpclient:
        inputs[0].set_data_from_numpy(input0_data, binary_data=True)
        inputs[1].set_data_from_numpy(input1_data, binary_data=False)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=False)]
    else:
        inputs[0].set_data_from_numpy(input0_data)
        inputs[1].set_data_from_numpy(input1_data)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
    results = client.infer(model_name="simple_string", inputs=inputs, outputs=outputs)
    sums = [int(value) for value in results.as_numpy("OUTPUT0")[0]]
    differences = [int(value) for value in results.as_numpy("OUTPUT1")[0]]
    assert (sums, differences) == ((in0 + in1)[0].tolist(), (in0 - in1)[0].tolist())


def identity_inference(module, client, np_array: np.ndarray, binary_data: bool | None) -> None:
    inputs = [module.InferInput("INPUT0", np_array.shape, "BYTES")]
    if binary_data is None:  # gRPC
        inputs[0].set_data_from_numpy(np_array)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0")]
    else:
        inputs[0].set_data_from_numpy(np_array, binary_data=binary_data)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_data)]
    output = client.infer(model_name="simple_identity", inputs=inputs, outputs=outputs).as_numpy("OUTPUT0")
    if np_array.dtype == np.object_:
        if binary_data is False:
            output = np.array([str(x).encode("utf-8") for x in output.flatten()], dtype=np.object_).reshape(1, 16)
        assert np.array_equal(np_array, output)
    else:
        assert np.array_equal(np_array, np.char.encode(output.astype(str)))


NULL_CHARS = np.array([b"he\x00llo" for _ in range(16)], dtype=np.object_).reshape(1, 16)
BYTES_DATA = np.array([b"\x00\x01\x02\x03" for _ in range(16)], dtype=np.bytes_).reshape(1, 16)


def test_simple_http_string_infer_client(l0_http):
    client = httpclient.InferenceServerClient(url=url(l0_http))
    string_inference(httpclient, client)
    for data in (NULL_CHARS, BYTES_DATA):
        identity_inference(httpclient, client, data, True)
        identity_inference(httpclient, client, data, False)


# L0_http test.sh's curl checks against `simple`: (name, body, expect 200?, [(text, whether the body holds it)]).
_IN = ('{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]},'
       '{"name":"INPUT1","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}')
_SUM, _DIFF = "[2,4,6,8,10,12,14,16,18,20,22,24,26,28,30,32]", "[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]"
CURL = [
    ("json outputs by default", '{"inputs":[' + _IN + ']}', True, [(_SUM, True), (_DIFF, True)]),
    ("OUTPUT0 binary, OUTPUT1 binary_data false",
     '{"inputs":[' + _IN + '],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}},'
     '{"name":"OUTPUT1","parameters":{"binary_data":false}}]}', True, [(_SUM, False), (_DIFF, True)]),
    ("OUTPUT0 binary, OUTPUT1 unset",
     '{"inputs":[' + _IN + '],"outputs":[{"name":"OUTPUT0","parameters":{"binary_data":true}},{"name":"OUTPUT1"}]}',
     True, [(_SUM, False), (_DIFF, True)]),
    ("binary_data_output true", '{"parameters":{"binary_data_output":true},"inputs":[' + _IN + ']}', True,
     [(_SUM, False), (_DIFF, False)]),
    ("binary_data_output true, OUTPUT0 binary_data false",
     '{"parameters":{"binary_data_output":true},"inputs":[' + _IN + '],"outputs":[{"name":"OUTPUT0",'
     '"parameters":{"binary_data":false}},{"name":"OUTPUT1"}]}', True, [(_SUM, True), (_DIFF, True)]),
    ("15 values for [1,16]",
     '{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}]}',
     False, [('{"error":"Failed to parse \'data\' field: shape does not match true shape"}', True)]),
    ("18 values for [1,16]",
     '{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[1,16],"data":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,'
     '16,17,18]}]}', False,
     [('{"error":"Unable to parse \'data\': Shape does not match true shape of \'data\' field"}', True)]),
]


@pytest.mark.parametrize("name, body, ok, greps", CURL, ids=[name for name, *_ in CURL])
def test_l0_http_curl_checks(l0_http, name, body, ok, greps):
    r = requests.post(f"{l0_http.url}/v2/models/simple/infer", data=body, timeout=TIMEOUT_S)
    text = r.content.decode("latin-1")
    assert ok == (r.status_code == 200), text
    for needle, present in greps:
        assert (needle in text) == present, text


# -- the client examples L0_grpc's test.sh runs ----------------------------------------------------


def grpc_inputs(module=grpcclient, input1_data: np.ndarray | None = None) -> list:
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    inputs[0].set_data_from_numpy(INPUT0)
    inputs[1].set_data_from_numpy(np.ones(shape=(1, 16), dtype=np.int32) if input1_data is None else input1_data)
    return inputs


def grpc_outputs(module=grpcclient) -> list:
    return [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]


ONES = np.ones(shape=(1, 16), dtype=np.int32)


def test_simple_grpc_health_metadata(l0_grpc):
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    assert client.is_server_live(headers={"test": "1", "dummy": "2"})
    assert client.is_server_ready()
    assert client.is_model_ready("simple")
    assert client.get_server_metadata().name == "tensorflow-model-server"  # Triton's: "triton"
    assert client.get_model_metadata("simple", headers={"test": "1", "dummy": "2"}).name == "simple"
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_metadata("wrong_model_name")
    assert "Request for unknown model" in unknown.value.message()
    assert client.get_model_config("simple").config.name == "simple"


def test_simple_grpc_aio_infer_client(l0_grpc):
    async def main():
        client = grpcclient_aio.InferenceServerClient(url=l0_grpc.grpc_target)
        try:
            results = await client.infer(model_name="simple", inputs=grpc_inputs(grpcclient_aio),
                                         outputs=grpc_outputs(grpcclient_aio), headers={"test": "1"})
            assert len((await client.get_inference_statistics(model_name="simple")).model_stats) == 1
            validate_result(results, INPUT0, ONES)
            for result in await asyncio.gather(*(client.infer(model_name="simple", inputs=grpc_inputs(grpcclient_aio),
                                                              outputs=None) for _ in range(2))):
                validate_result(result, INPUT0, ONES)
        finally:
            await client.close()

    asyncio.run(main())


def test_simple_grpc_infer_client(l0_grpc):
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    results = client.infer(model_name="simple", inputs=grpc_inputs(), outputs=grpc_outputs(), headers={"test": "1"})
    assert len(client.get_inference_statistics(model_name="simple").model_stats) == 1
    validate_result(results, INPUT0, ONES)
    validate_result(client.infer(model_name="simple", inputs=grpc_inputs(), outputs=None), INPUT0, ONES)


def test_simple_grpc_infer_client_with_deflate(l0_grpc):
    """`simple_grpc_infer_client.py -C deflate`: the request compressed, the answer right."""
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    results = client.infer(model_name="simple", inputs=grpc_inputs(), outputs=grpc_outputs(),
                           compression_algorithm="deflate")
    validate_result(results, INPUT0, ONES)


def test_simple_grpc_async_infer_client(l0_grpc):
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    completed: queue.Queue = queue.Queue()
    client.async_infer(model_name="simple", inputs=grpc_inputs(), outputs=grpc_outputs(),
                       callback=lambda result, error: completed.put(error or result), client_timeout=TIMEOUT_S)
    result = completed.get(timeout=TIMEOUT_S)
    assert not isinstance(result, InferenceServerException)
    validate_result(result, INPUT0, ONES)


def test_simple_grpc_string_infer_client(l0_grpc):
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    string_inference(grpcclient, client)
    for data in (NULL_CHARS, BYTES_DATA):
        identity_inference(grpcclient, client, data, None)


def test_simple_grpc_keepalive_client(l0_grpc):
    keepalive = grpcclient.KeepAliveOptions(keepalive_time_ms=2**31 - 1, keepalive_timeout_ms=20000,
                                            keepalive_permit_without_calls=False, http2_max_pings_without_data=2)
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target, keepalive_options=keepalive)
    validate_result(client.infer(model_name="simple", inputs=grpc_inputs(), outputs=grpc_outputs(),
                                 headers={"test": "1"}), INPUT0, ONES)


def test_simple_grpc_custom_args_client(l0_grpc):
    channel_args = [("grpc.max_send_message_length", 1024 * 1024), ("grpc.max_receive_message_length", 1024 * 1024),
                    ("grpc.keepalive_time_ms", 2**31 - 1), ("grpc.keepalive_timeout_ms", 20000),
                    ("grpc.keepalive_permit_without_calls", False), ("grpc.http2.max_pings_without_data", 2),
                    ("grpc.dns_enable_srv_queries", 1)]
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target, channel_args=channel_args)
    validate_result(client.infer(model_name="simple", inputs=grpc_inputs(), outputs=grpc_outputs(),
                                 headers={"test": "1"}), INPUT0, ONES)


def explicit_request(model_name: str, datatype: str, field: str, input0_data: list, input1_data: list):
    request = service_pb2.ModelInferRequest(model_name=model_name, model_version="")
    for name, data in (("INPUT0", input0_data), ("INPUT1", input1_data)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 16])
        getattr(tensor.contents, field)[:] = data
    request.outputs.add(name="OUTPUT0")
    request.outputs.add(name="OUTPUT1")
    return request


def output_results(response, dtype=None) -> list[np.ndarray]:
    results = []
    for index, output in enumerate(response.outputs):
        raw = response.raw_output_contents[index]
        values = utils.deserialize_bytes_tensor(raw) if dtype is None else np.frombuffer(raw, dtype)
        results.append(np.resize(values, list(output.shape)))
    return results


@pytest.fixture
def stub(l0_grpc) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(l0_grpc.grpc_target) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_grpc_explicit_byte_content_client(stub):
    request = explicit_request("simple_string", "BYTES", "bytes_contents", [str(i).encode() for i in range(16)],
                               [b"1"] * 16)
    results = output_results(stub.ModelInfer(request, timeout=TIMEOUT_S))
    assert len(results) == 2
    assert [int(value) for value in results[0][0]] == [i + 1 for i in range(16)]
    assert [int(value) for value in results[1][0]] == [i - 1 for i in range(16)]


@pytest.mark.parametrize("model_name, datatype, dtype, refusal", [
    # grpc_explicit_int_content_client.py: raw_input_contents beside typed contents.
    ("simple", "INT32", np.int32,
     "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"),
    # grpc_explicit_int8_content_client.py: a version string that is not a version.
    ("simple_int8", "INT8", np.int8,
     "failed to get model version from specified version string 'wrong_specification'"),
], ids=["grpc_explicit_int_content_client", "grpc_explicit_int8_content_client"])
def test_grpc_explicit_int_content_client(stub, model_name, datatype, dtype, refusal):
    input0_data, input1_data = list(range(16)), [1] * 16
    request = explicit_request(model_name, datatype, "int_contents", input0_data, input1_data)
    results = output_results(stub.ModelInfer(request, timeout=TIMEOUT_S), dtype)
    assert len(results) == 2
    assert results[0][0].tolist() == [a + b for a, b in zip(input0_data, input1_data, strict=True)]
    assert results[1][0].tolist() == [a - b for a, b in zip(input0_data, input1_data, strict=True)]
    if datatype == "INT32":
        request.raw_input_contents.extend([np.array(input0_data[0:8]).tobytes()])
        request.inputs[0].contents.int_contents[:] = input0_data[8:]
    else:
        request.model_version = "wrong_specification"
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(request, timeout=TIMEOUT_S)
    assert refusal in str(refused.value)


def test_stream_infer_examples_order(l0_grpc):
    """Not an example of Triton's (its streaming examples need sequence batching): tritonclient's
    stream on an ordinary model, each answer in order, with its request's id."""
    client = grpcclient.InferenceServerClient(url=l0_grpc.grpc_target)
    completed: queue.Queue = queue.Queue()
    client.start_stream(partial(lambda done, result, error: done.put(error or result), completed))
    for index in range(5):
        client.async_stream_infer("simple", grpc_inputs(input1_data=np.full((1, 16), index, np.int32)),
                                  request_id=str(index))
    results = [completed.get(timeout=TIMEOUT_S) for _ in range(5)]
    client.stop_stream()
    assert [result.get_response().id for result in results] == [str(index) for index in range(5)]
    for index, result in enumerate(results):
        validate_result(result, INPUT0, np.full((1, 16), index, np.int32))
