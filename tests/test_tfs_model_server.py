"""TF Serving's own integration suite (model_servers/tensorflow_model_server_test.py), test by test.

Each test here has the name of its counterpart there, in snake case, starts this server with that
test's flags (RunServer in test_util/tensorflow_model_server_test_base.py, through
`python -m app.tfs_flags`), sends the same requests with TF Serving's own client stubs, and
asserts what it asserts, with exact values; some assert a little more. The models are TF
Serving's test models, built by scripts/tfs_models.py.

RunServer starts one server per model; here the tests that only read share one server, started
from a model config file that names each of their models (`model_server`): TF Serving's
'default' is half_plus_two, and each other test's model is served under a name of its own (no
test depends on another model's absence). The config reload test polls its file, and so gets a
server of its own. The same server also serves TF Serving's other test models, for the tests at
the end that go beyond its suite (other export structures, signatures without inputs). The tests
of that suite that cannot pass here, and why, are listed in docs/tf-serving.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_metadata_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from scripts.live_server import REPO, LiveServer, free_ports
from tests.conftest import wait_for
from tests.tfs_models import (
    HALF_PLUS_TWO_SIGNATURES,
    UNKNOWN_RANK,
    VERSION,
    assert_y,
    dims,
    predict_x,
    signature_document,
    tfs_models,  # noqa: F401  (a fixture)
)

# TF Serving's test waits 20 s for an RPC; this machine may be shared by other test runs.
TIMEOUT_S = 60
HTTP_REST_TIMEOUT_MS = 5000  # RunServer's --rest_api_timeout_in_ms
DT_FLOAT = 1
DEFAULT_SIGNATURE = "serving_default"


class ModelServer(LiveServer):
    """`python -m app.tfs_flags` with RunServer's flags: its own ports, then the model's flags."""

    def __init__(self, log_dir: Path, flags: tuple[str, ...]) -> None:
        super().__init__(log_dir, {"TFS_LISTEN_HOST": "127.0.0.1"})
        self.grpc_port = next(port for port in free_ports(2) if port != self.port)
        self.grpc_target = f"127.0.0.1:{self.grpc_port}"
        self.flags = flags
        self.socket_path = log_dir / f"grpc-{self.grpc_port}.sock"
        self._channel: grpc.Channel | None = None

    def channel(self) -> grpc.Channel:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.grpc_target)
        return self._channel

    def stop(self, **kwargs) -> int:
        if self._channel is not None:
            self._channel.close()
        return super().stop(**kwargs)

    def command(self, *, workers: int) -> list[str]:
        # The command has no --workers flag: gunicorn.conf.py reads WORKERS.
        self.env["WORKERS"] = str(workers)
        return [sys.executable, "-m", "app.tfs_flags", *self.run_server_flags(), *self.flags]

    def run_server_flags(self) -> list[str]:
        """The flags RunServer passes to every server."""
        return [f"--port={self.grpc_port}", f"--rest_api_port={self.port}",
                f"--rest_api_timeout_in_ms={HTTP_REST_TIMEOUT_MS}",
                f"--grpc_socket_path={self.socket_path}", "--grpc_channel_arguments=grpc.so_reuseaddr=1"]


# Model name as served -> the built model it serves. "default" is the name TF Serving's tests
# give half_plus_two; half_plus_two and half_plus_three are good_model_config.txt's two models.
SERVED = {
    "default": "half_plus_two",
    "half_plus_two": "half_plus_two",
    "half_plus_three": "half_plus_three",
    "half_plus_two_tf2": "half_plus_two_tf2",
    "tf_saved_model_save": "tf_saved_model_save",
    "multiple_signatures": "multiple_signatures",
    "keras_sequential": "keras_sequential",
    "keras_sequential_mirrored": "keras_sequential_mirrored",
    "tf_text_regression": "tf_text_regression",
    "half_plus_two_main_op": "half_plus_two_main_op",
    "half_plus_two_2_versions": "half_plus_two_2_versions",
    "counter": "counter",
}


def config_text(models: dict[str, Path]) -> str:
    """A ModelServerConfig in text format, as good_model_config.txt writes it: name -> base path."""
    return "model_config_list: {\n" + ",\n".join(
        f'  config: {{ name: "{name}", base_path: "{path}", model_platform: "tensorflow" }}'
        for name, path in models.items()) + "\n}\n"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory, tfs_models, keras_models) -> Path:  # noqa: F811
    """The file `model_server` reads: every model of SERVED."""
    config = tmp_path_factory.mktemp("tfs-model-config") / "model_config.txt"
    built = {**tfs_models, **keras_models}
    config.write_text(config_text({name: built[model] for name, model in SERVED.items()}))
    return config


@pytest.fixture(scope="module")
def model_server(tmp_path_factory, model_config) -> Iterator[ModelServer]:
    """The server of every test that only reads; not polling its file (TF Serving's default)."""
    server = ModelServer(tmp_path_factory.mktemp("tfs-model-server"),
                         (f"--model_config_file={model_config}", "--model_config_file_poll_wait_seconds=0"))
    server.start()
    yield server
    server.stop()


def model_flags(name: str | None, path: Path) -> tuple[str, ...]:
    """RunServer(model_name, model_path): --model_name and --model_base_path."""
    return f"--model_name={name}", f"--model_base_path={path}"


@pytest.fixture
def half_plus_two(model_server) -> ModelServer:
    """RunServer('default', _GetSavedModelBundlePath()): served as 'default'."""
    return model_server


@pytest.fixture
def half_plus_two_tf2(model_server) -> ModelServer:
    """RunServer('default', _GetSavedModelHalfPlusTwoTf2()): served as 'half_plus_two_tf2'."""
    return model_server


@pytest.fixture(scope="module")
def keras_models(tmp_path_factory) -> dict[str, Path]:
    """The Keras models, saved in a process of their own (the mirrored one needs two virtual CPUs)."""
    root = tmp_path_factory.mktemp("keras")
    subprocess.run([sys.executable, "-m", "scripts.tfs_models", str(root)], cwd=REPO, check=True, timeout=300,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    return {name: root / name for name in ("keras_sequential", "keras_sequential_mirrored")}


# -- the requests and checks of TF Serving's test base --------------------------------------------


def prediction_stub(server: ModelServer) -> prediction_service_pb2_grpc.PredictionServiceStub:
    return prediction_service_pb2_grpc.PredictionServiceStub(server.channel())


def verify_model_spec(model_spec, name: str, signature_name: str, version: int) -> None:
    """_VerifyModelSpec."""
    assert (model_spec.name, model_spec.signature_name, model_spec.version.value) == (name, signature_name, version)


def verify_predict_request(server: ModelServer, *, expected_output: float, expected_version: int = VERSION,
                           model_name: str = "default", specify_output: bool = True, batch_input: bool = False,
                           signature_name: str = DEFAULT_SIGNATURE, x: float = 2.0) -> None:
    """VerifyPredictRequest: x = [2.0] (or [[2.0]]) -> y holds one DT_FLOAT, expected_output."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    request.inputs["x"].dtype = DT_FLOAT
    request.inputs["x"].float_val.append(x)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    if batch_input:
        request.inputs["x"].tensor_shape.dim.add().size = 1
    if specify_output:
        request.output_filter.append("y")
    result = prediction_stub(server).Predict(request, TIMEOUT_S)
    assert list(result.outputs) == ["y"]
    assert (result.outputs["y"].dtype, list(result.outputs["y"].float_val)) == (DT_FLOAT, [expected_output])
    verify_model_spec(result.model_spec, model_name, signature_name, expected_version)


def predict_with_and_without_filter(server: ModelServer) -> None:
    """_TestPredict: with and without the output filter."""
    verify_predict_request(server, expected_output=3.0)
    verify_predict_request(server, expected_output=3.0, specify_output=False)


def with_example(message, model: str, signature_name: str, *xs: float):
    """A Classify or Regress request to `model`, one tf.Example with feature x per value."""
    request = message()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    for x in xs:
        request.input.example_list.examples.add().features.feature["x"].float_list.value.append(x)
    return request


def call_rest(server: ModelServer, path: str, body=None) -> dict:
    """CallREST: POST the JSON body, or GET without one; the answer must be 200."""
    url = server.url + path
    answer = (requests.get(url, timeout=TIMEOUT_S) if body is None
              else requests.post(url, data=json.dumps(body), timeout=TIMEOUT_S))
    assert answer.status_code == 200, answer.text
    return answer.json()


# -- RunServer('default', half_plus_two) ----------------------------------------------------------


def test_get_model_status(half_plus_two):
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "default"
    stub = model_service_pb2_grpc.ModelServiceStub(half_plus_two.channel())
    result = stub.GetModelStatus(request, TIMEOUT_S)
    assert [(status.version, status.state, status.status.error_code, status.status.error_message)
            for status in result.model_version_status] == [
        (VERSION, get_model_status_pb2.ModelVersionStatus.AVAILABLE, 0, "")]


def test_get_model_metadata(half_plus_two):
    """Also: the signature defs are those of TF Serving's half_plus_two_model_metadata.json."""
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "default"
    result = prediction_stub(half_plus_two).GetModelMetadata(request, TIMEOUT_S)
    assert (result.model_spec.name, result.model_spec.version.value, list(result.metadata)) == (
        "default", VERSION, ["signature_def"])
    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert result.metadata["signature_def"].Unpack(signatures)
    assert {key: signature_as_json(value) for key, value in signatures.signature_def.items()} == (
        HALF_PLUS_TWO_SIGNATURES)


def signature_as_json(proto) -> dict:
    """A SignatureDef proto written as TF Serving's REST metadata writes it."""
    def tensors(mapping):
        return {key: {"dtype": {1: "DT_FLOAT", 7: "DT_STRING"}[info.dtype],
                      "tensor_shape": {"dim": [{"size": str(dim.size), "name": dim.name}
                                               for dim in info.tensor_shape.dim],
                                       "unknown_rank": info.tensor_shape.unknown_rank},
                      "name": info.name} for key, info in mapping.items()}

    return {"inputs": tensors(proto.inputs), "outputs": tensors(proto.outputs), "method_name": proto.method_name,
            "defaults": dict(proto.defaults)}


def classify(server: ModelServer, model: str = "default") -> None:
    """_TestClassify: one example x = 2.0 on classify_x_to_y -> one class, score 3.0 (label '')."""
    request = with_example(classification_pb2.ClassificationRequest, model, "classify_x_to_y", 2.0)
    result = prediction_stub(server).Classify(request, TIMEOUT_S)
    assert [[(c.label, c.score) for c in entry.classes] for entry in result.result.classifications] == [[("", 3.0)]]
    verify_model_spec(result.model_spec, model, "classify_x_to_y", VERSION)


def regress(server: ModelServer, model: str = "default") -> None:
    """_TestRegress: x = 2.0 on regress_x_to_y -> 3.0; also two examples, and regress_x_to_y2."""
    stub = prediction_stub(server)
    result = stub.Regress(with_example(regression_pb2.RegressionRequest, model, "regress_x_to_y", 2.0), TIMEOUT_S)
    assert [entry.value for entry in result.result.regressions] == [3.0]
    verify_model_spec(result.model_spec, model, "regress_x_to_y", VERSION)
    two = stub.Regress(with_example(regression_pb2.RegressionRequest, model, "regress_x_to_y", 2.0, -4.0), TIMEOUT_S)
    assert [entry.value for entry in two.result.regressions] == [3.0, 0.0]
    y2 = stub.Regress(with_example(regression_pb2.RegressionRequest, model, "regress_x_to_y2", 2.0), TIMEOUT_S)
    assert [entry.value for entry in y2.result.regressions] == [4.0]  # 0.5 x + 3


def multi_inference(server: ModelServer, model: str = "default") -> None:
    """_TestMultiInference: regress then classify over one example x = 2.0; both 3.0, in order."""
    request = inference_pb2.MultiInferenceRequest()
    for signature, method in (("regress_x_to_y", "regress"), ("classify_x_to_y", "classify")):
        task = request.tasks.add()
        task.model_spec.name = model
        task.model_spec.signature_name = signature
        task.method_name = f"tensorflow/serving/{method}"
    request.input.example_list.examples.add().features.feature["x"].float_list.value.append(2.0)
    result = prediction_stub(server).MultiInference(request, TIMEOUT_S)
    assert len(result.results) == 2
    assert [entry.value for entry in result.results[0].regression_result.regressions] == [3.0]
    assert [[(c.label, c.score) for c in entry.classes]
            for entry in result.results[1].classification_result.classifications] == [[("", 3.0)]]
    for answer, task in zip(result.results, request.tasks, strict=True):
        verify_model_spec(answer.model_spec, model, task.model_spec.signature_name, VERSION)


def test_classify(half_plus_two):
    classify(half_plus_two)


def test_regress(half_plus_two):
    regress(half_plus_two)


def test_multi_inference(half_plus_two):
    multi_inference(half_plus_two)


def test_predict_saved_model(half_plus_two):
    """Also: x of shape [1, 1] (a batch of one row), x = 5.0 -> 4.5."""
    predict_with_and_without_filter(half_plus_two)
    verify_predict_request(half_plus_two, expected_output=4.5, batch_input=True, x=5.0)


def test_classify_rest(half_plus_two):
    assert call_rest(half_plus_two, "/v1/models/default:classify", {
        "signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]}) == {"results": [[["", 3.0]]]}


def test_regress_rest(half_plus_two):
    assert call_rest(half_plus_two, "/v1/models/default:regress", {
        "signature_name": "regress_x_to_y", "examples": [{"x": 2.0}]}) == {"results": [3.0]}


def test_predict_rest(half_plus_two):
    assert call_rest(half_plus_two, "/v1/models/default:predict", {"instances": [2.0, 3.0, 4.0]}) == {
        "predictions": [3.0, 3.5, 4.0]}


def test_predict_columnar_rest(half_plus_two):
    assert call_rest(half_plus_two, "/v1/models/default:predict", {"inputs": [2.0, 3.0, 4.0]}) == {
        "outputs": [3.0, 3.5, 4.0]}


def test_get_status_rest(half_plus_two):
    assert call_rest(half_plus_two, "/v1/models/default") == {"model_version_status": [
        {"version": str(VERSION), "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}


def test_get_model_metadata_rest(half_plus_two):
    """The whole document of half_plus_two_model_metadata.json (compared whole; its lists hold one order)."""
    assert call_rest(half_plus_two, "/v1/models/default/metadata") == {
        "model_spec": {"name": "default", "signature_name": "", "version": str(VERSION)},
        "metadata": {"signature_def": {"signature_def": HALF_PLUS_TWO_SIGNATURES}}}


def worker_maps_tensorflow_text(server: ModelServer) -> bool:
    """Whether a worker process has mapped a file of the tensorflow-text package (its op libraries)."""
    workers = server.processes()[1:]
    assert workers
    return any("tensorflow_text" in region.path for worker in workers for region in worker.memory_maps())


# -- RunServer('default', half_plus_two_tf2) ------------------------------------------------------


def test_classify_tf2(half_plus_two_tf2):
    classify(half_plus_two_tf2, "half_plus_two_tf2")


def test_regress_tf2(half_plus_two_tf2):
    regress(half_plus_two_tf2, "half_plus_two_tf2")


def test_multi_inference_tf2(half_plus_two_tf2):
    multi_inference(half_plus_two_tf2, "half_plus_two_tf2")


# -- --model_config_file --------------------------------------------------------------------------


def test_good_model_config(model_server):
    """good_model_config.txt's two models, half_plus_two and half_plus_three (among the others of SERVED)."""
    for name, expected in (("half_plus_two", 3.0), ("half_plus_three", 4.0)):
        verify_predict_request(model_server, model_name=name, expected_output=expected)
        verify_predict_request(model_server, model_name=name, expected_output=expected, specify_output=False)


def test_bad_model_config(tmp_path):
    """bad_model_config.txt: the server stops, its error output naming the parse error."""
    config = tmp_path / "bad_model_config.txt"
    config.write_text("improperly formatted file")
    server = ModelServer(tmp_path, (f"--model_config_file={config}",))
    done = subprocess.run(server.command(workers=1), cwd=REPO, env=server.env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert done.returncode == 1
    assert "Error parsing text-format tensorflow.serving.ModelServerConfig" in done.stderr


def test_model_config_reload_with_zero_poll_period(model_server, model_config, tfs_models):  # noqa: F811
    """Not polled: after the file is rewritten, half_plus_two is still served and the model the
    new file names is not (half_plus_three, under a name nothing else serves). The file is put back."""
    served = model_config.read_text()
    verify_predict_request(model_server, model_name="half_plus_two", expected_output=3.0, specify_output=False)
    model_config.write_text(config_text({"added_by_reload": tfs_models["half_plus_three"]}))
    try:
        # What must not happen has no event to wait on: TF Serving's test gives the server one
        # poll period and a second (here, the 1 s it would take a server that polled by default).
        time.sleep(2)
        verify_predict_request(model_server, model_name="half_plus_two", expected_output=3.0, specify_output=False)
        with pytest.raises(grpc.RpcError) as unserved:
            verify_predict_request(model_server, model_name="added_by_reload", expected_output=4.0)
        assert unserved.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        model_config.write_text(served)


@pytest.fixture(scope="module")
def polled_config(tmp_path_factory, tfs_models) -> Path:  # noqa: F811
    """The file testModelConfigReload writes first: half_plus_two alone."""
    config = tmp_path_factory.mktemp("tfs-polled-config") / "model_config.txt"
    config.write_text(config_text({"half_plus_two": tfs_models["half_plus_two"]}))
    return config


@pytest.fixture(scope="module")
def polled_server(tmp_path_factory, polled_config) -> Iterator[ModelServer]:
    """testModelConfigReload's server: its file polled each second."""
    server = ModelServer(tmp_path_factory.mktemp("tfs-polled-server"),
                         (f"--model_config_file={polled_config}", "--model_config_file_poll_wait_seconds=1"))
    server.start()
    yield server
    server.stop()


def test_tensorflow_text_is_not_imported_for_a_model_without_its_ops(polled_server):
    """TF Text's ops are loaded only for a model that needs them (test_tf_text): importing them costs
    start-up time. Checked on the one server here that serves no such model."""
    assert not worker_maps_tensorflow_text(polled_server)


def test_model_config_reload(polled_server, polled_config, tfs_models):  # noqa: F811
    """Polled each second, the rewritten file's model is served (polled for here, where TF Serving's
    test sleeps 10 s); also: the model it no longer names is not. The file is put back, and applied."""
    served = polled_config.read_text()
    verify_predict_request(polled_server, model_name="half_plus_two", expected_output=3.0, specify_output=False)
    polled_config.write_text(config_text({"half_plus_three": tfs_models["half_plus_three"]}))
    try:
        wait_for(lambda: requests.get(f"{polled_server.url}/v1/models/half_plus_three", timeout=TIMEOUT_S).ok,
                 within_s=120, what="half_plus_three served")
        verify_predict_request(polled_server, model_name="half_plus_three", expected_output=4.0,
                               specify_output=False)
        with pytest.raises(grpc.RpcError) as removed:
            verify_predict_request(polled_server, model_name="half_plus_two", expected_output=3.0)
        assert removed.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        polled_config.write_text(served)
    wait_for(lambda: requests.get(f"{polled_server.url}/v1/models/half_plus_two", timeout=TIMEOUT_S).ok,
             within_s=120, what="half_plus_two served again")


# -- models saved by tf.saved_model.save ----------------------------------------------------------


def test_tf_saved_model_save(model_server):
    """y = 3 * 2 * x for x of unknown rank; also over REST, two values."""
    verify_predict_request(model_server, model_name="tf_saved_model_save", expected_output=12.0,
                           specify_output=False)
    assert call_rest(model_server, "/v1/models/tf_saved_model_save:predict", {"instances": [1.0, -0.5]}) == {
        "predictions": [6.0, -3.0]}


def test_tf_saved_model_save_multiple_signatures(model_server):
    verify_predict_request(model_server, model_name="multiple_signatures", expected_output=2.0,
                           signature_name="custom_signature_key")
    verify_predict_request(model_server, model_name="multiple_signatures", expected_output=1.0)


def test_sequential_keras_saved_model_save(model_server):
    verify_predict_request(model_server, model_name="keras_sequential", batch_input=True, specify_output=False,
                           expected_output=2.0)


def test_distrat_sequential_keras_saved_model_save(model_server):
    """Saved under a MirroredStrategy over two CPUs; served without one."""
    verify_predict_request(model_server, model_name="keras_sequential_mirrored", batch_input=True,
                           specify_output=False, expected_output=2.0)


def test_tf_text(model_server):
    """A model using TF Text's ops, which TensorFlow itself lacks."""
    verify_predict_request(model_server, model_name="tf_text_regression", expected_output=3.0)
    assert worker_maps_tensorflow_text(model_server)


# -- beyond TF Serving's suite: other export structures, served by the same server ----------------
# (main_op, TF 1.0 shapes, two versions, TF2 metadata, signatures without inputs)


@pytest.fixture(scope="module")
def stub(model_server) -> Iterator[prediction_service_pb2_grpc.PredictionServiceStub]:
    with grpc.insecure_channel(model_server.grpc_target) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def post(server: ModelServer, path: str, body) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), timeout=TIMEOUT_S)


def test_main_op_export_loads_and_answers(stub, model_server):
    """The asset-based init op given as main_op instead of legacy_init_op."""
    assert_y(stub.Predict(predict_x("half_plus_two_main_op", 2.0), TIMEOUT_S), 3.0, model="half_plus_two_main_op")
    assert post(model_server, "/v1/models/half_plus_two_main_op:regress",
                {"signature_name": "regress_x_to_y2", "examples": [{"x": 1.0}, {"x": 7.0}]}).json() == {
        "results": [3.5, 6.5]}
    assert post(model_server, "/v1/models/half_plus_two_main_op:predict",
                {"signature_name": "regress_x2_to_y3", "instances": [[1.0], [0.0]]}).json() == {
        "predictions": [[3.5], [3.0]]}


def test_half_plus_three_with_tf_1_0_scalar_shapes_answers_api_rest_curl_lines(model_server, stub):
    """Its signatures declare scalars although they carry batches; TF Serving feeds what it gets."""
    assert post(model_server, "/v1/models/half_plus_three:predict", {"instances": [1.0, 2.0, 5.0]}).json() == {
        "predictions": [3.5, 4.0, 5.5]}
    assert post(model_server, "/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress",
                                                                "examples": [{"x": 1.0}, {"x": 2.0}]}).json() == {
        "results": [3.5, 4.0]}
    assert_y(stub.Predict(predict_x("half_plus_three", 2.0), TIMEOUT_S), 4.0, model="half_plus_three")
    metadata = requests.get(model_server.url + "/v1/models/half_plus_three/metadata", timeout=TIMEOUT_S).json()
    x = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["x"]
    assert x == {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [], "unknown_rank": False}, "name": "x:0"}


def test_two_versions_serve_the_newest_as_tf_servings_default_policy(model_server, stub):
    status = requests.get(model_server.url + "/v1/models/half_plus_two_2_versions", timeout=TIMEOUT_S).json()
    assert [entry["version"] for entry in status["model_version_status"]] == [str(VERSION + 1)]
    assert_y(stub.Predict(predict_x("half_plus_two_2_versions", 2.0), TIMEOUT_S), 3.0,
             model="half_plus_two_2_versions", version=VERSION + 1)


# -- TF2 exports, and signatures without inputs ---------------------------------------------------


def test_tf2_half_plus_two_predicts_over_its_fixed_shape_signature(stub, model_server):
    """Its serving_default takes shape [1] (no batch dimension), as TF Serving's TF2 model does."""
    assert_y(stub.Predict(predict_x("half_plus_two_tf2", 2.0), TIMEOUT_S), 3.0, model="half_plus_two_tf2")
    metadata = requests.get(model_server.url + "/v1/models/half_plus_two_tf2/metadata", timeout=TIMEOUT_S).json()
    signatures = metadata["metadata"]["signature_def"]["signature_def"]
    assert signatures["serving_default"]["inputs"] == {"x": {"dtype": "DT_FLOAT", "tensor_shape": dims(1),
                                                             "name": "serving_default_x:0"}}
    assert signatures["regress_x_to_y"]["inputs"]["inputs"] == {"dtype": "DT_STRING", "tensor_shape": dims(-1),
                                                                "name": "regress_x_to_y_inputs:0"}
    assert sorted(signatures) == ["classify_x2_to_y3", "classify_x_to_y", "regress_x2_to_y3", "regress_x_to_y",
                                  "regress_x_to_y2", "serving_default"]


def test_counter_signatures_without_inputs(model_server):
    """export_counter.py's model: stateful signatures that take no input and answer a scalar."""
    def call(signature: str, inputs: dict | None = None) -> float:
        answer = post(model_server, "/v1/models/counter:predict", {"signature_name": signature, "inputs": inputs or {}})
        return answer.json()["outputs"]

    assert call("reset_counter") == 0.0
    assert call("incr_counter") == 1.0
    assert call("incr_counter_by", {"delta": 3.0}) == 4.0
    assert call("get_counter") == 4.0


def test_readyz_names_the_signatures_served_unbatched(model_server):
    """Signatures without a batch dimension on every input and output run one request per call."""
    served = requests.get(model_server.url + "/readyz", timeout=TIMEOUT_S).json()["models"]
    assert served["counter"]["unbatched_signatures"] == ["get_counter", "incr_counter", "incr_counter_by",
                                                         "reset_counter"]
    assert served["multiple_signatures"]["unbatched_signatures"] == ["custom_signature_key", "serving_default"]
    # Over serialized tf.Examples of unknown rank: no batch dimension to stack on.
    assert served["default"]["unbatched_signatures"] == ["classify_x_to_y", "regress_x_to_y", "regress_x_to_y2"]


def test_counter_and_scalar_signatures_load_and_are_described(model_server):
    """They load and are described as the SignatureDef declares them. The
    output fetches a reference variable: TF Serving's metadata copies DT_FLOAT_REF from the
    SignatureDef; this model_server names the dtype the answer has."""
    counter = requests.get(model_server.url + "/v1/models/counter/metadata", timeout=TIMEOUT_S).json()
    signatures = counter["metadata"]["signature_def"]["signature_def"]
    assert signatures["incr_counter_by"] == signature_document(
        "predict", {"delta": ("DT_FLOAT", UNKNOWN_RANK, "delta:0")},
        {"output": ("DT_FLOAT", dims(), "incr_counter_by_op/AssignAdd:0")})
    assert signatures["get_counter"]["inputs"] == {}


def test_rows_of_one_value_for_an_input_declared_minus_one_by_one_are_rows(stub):
    """gRPC used to refuse x of shape [3] for x declared [-1, 1] ('must have shape [1]; the tensor
    has shape [3]'); TF Serving feeds it. The answer keeps the rows, one value each."""
    request = predict_x("default", 0.0)
    del request.inputs["x"].float_val[:]
    request.inputs["x"].float_val.extend([2.0, 3.0, 4.0])
    request.inputs["x"].tensor_shape.dim[0].size = 3
    response = stub.Predict(request, TIMEOUT_S)
    assert list(response.outputs["y"].float_val) == [3.0, 3.5, 4.0]
    np.testing.assert_array_equal([dim.size for dim in response.outputs["y"].tensor_shape.dim], [3, 1])


# -- what this server refuses ---------------------------------------------------------------------


def test_tflite_models_are_refused_at_start(tfs_models, tmp_path):  # noqa: F811
    """testPredictOnTfLite and testPredictWithSignatureDefOnTfLite: RunServer(model_type='tflite')
    adds --prefer_tflite_model=true, and there is no TF Lite here."""
    server = ModelServer(tmp_path, (*model_flags("default", tfs_models["half_plus_two"]), "--prefer_tflite_model=true"))
    done = subprocess.run(server.command(workers=1), cwd=REPO, env=server.env, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False)
    assert (done.returncode, done.stderr.strip()) == (1, "tensorflow_model_server flags: --prefer_tflite_model=true "
                                                         "is not supported by this server (no TensorFlow Lite)")
