"""TF Serving's own test models (their structure, built by tests/tfs_models.py) served together
by one real server, beyond what model_servers/tensorflow_model_server_test.py asks (its tests
have their counterparts in test_tfs_model_server.py): other TF1 export structures, two
versions, TF2 metadata, signatures without inputs, and loading without a server.

Each expected value is the model's own arithmetic (half_plus_two: y = 0.5 x + 2), exact in float32.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import (
    predict_pb2,
    prediction_service_pb2_grpc,
)

from app import models
from tests.conftest import Server
from tests.tfs_models import (
    HALF_PLUS_TWO_SIGNATURES,
    UNKNOWN_RANK,
    VERSION,
    dims,
    signature_document,
    tfs_models,  # noqa: F401  (a fixture)
)

TIMEOUT_S = 60

# Model name as served -> the generated model it serves. "default" is the name TF Serving's test uses.
SERVED = {
    "default": "half_plus_two",
    "half_plus_two_main_op": "half_plus_two_main_op",
    "half_plus_three": "half_plus_three",
    "half_plus_two_2_versions": "half_plus_two_2_versions",
    "half_plus_two_tf2": "half_plus_two_tf2",
    "multiple_signatures": "multiple_signatures",
    "counter": "counter",
}


@pytest.fixture(scope="module")
def server(tfs_models, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("tfs-config")
    config = {"models": [{"name": name, "path": str(tfs_models[model])} for name, model in SERVED.items()],
              "default": "default"}
    (root / "models.json").write_text(json.dumps(config))
    running = Server(tmp_path_factory.mktemp("tfs-logs"), {
        "MODEL_CONFIG": str(root / "models.json"), "MODEL_POLL_SECONDS": "0"}).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def post(server: Server, path: str, body) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), timeout=TIMEOUT_S)


def predict_x(model: str, value: float, *, signature_name: str = "serving_default", output_filter: bool = True,
              batch_input: bool = False) -> predict_pb2.PredictRequest:
    """As TF Serving's VerifyPredictRequest writes it: x = [value] in float_val, shape [1] (or [1, 1])."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    tensor = request.inputs["x"]
    tensor.dtype = 1  # DT_FLOAT
    tensor.float_val.append(value)
    tensor.tensor_shape.dim.add().size = 1
    if batch_input:
        tensor.tensor_shape.dim.add().size = 1
    if output_filter:
        request.output_filter.append("y")
    return request


def example_request(message, model: str, signature_name: str, x: float):
    request = message()
    request.model_spec.name = model
    request.model_spec.signature_name = signature_name
    request.input.example_list.examples.add().features.feature["x"].float_list.value.append(x)
    return request


def assert_y(response, expected: float, *, model: str, version: int = VERSION,
             signature_name: str = "serving_default") -> None:
    """VerifyPredictRequest's checks: y is DT_FLOAT with one value in float_val, and the model spec."""
    y = response.outputs["y"]
    assert (y.dtype, list(y.float_val), y.tensor_content) == (1, [expected], b"")
    assert (response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name) == (
        model, version, signature_name)


# -- TF1 half_plus_two: Predict, Classify, Regress, metadata, status -------------------------


# -- other TF1 structures: main_op, TF 1.0 shapes, two versions ----------------------------


def test_main_op_export_loads_and_answers(stub, server):
    """The asset-based init op given as main_op instead of legacy_init_op."""
    assert_y(stub.Predict(predict_x("half_plus_two_main_op", 2.0), TIMEOUT_S), 3.0, model="half_plus_two_main_op")
    assert post(server, "/v1/models/half_plus_two_main_op:regress",
                {"signature_name": "regress_x_to_y2", "examples": [{"x": 1.0}, {"x": 7.0}]}).json() == {
        "results": [3.5, 6.5]}
    assert post(server, "/v1/models/half_plus_two_main_op:predict",
                {"signature_name": "regress_x2_to_y3", "instances": [[1.0], [0.0]]}).json() == {
        "predictions": [[3.5], [3.0]]}


def test_half_plus_three_with_tf_1_0_scalar_shapes_answers_api_rest_curl_lines(server, stub):
    """Its signatures declare scalars although they carry batches; TF Serving feeds what it gets."""
    assert post(server, "/v1/models/half_plus_three:predict", {"instances": [1.0, 2.0, 5.0]}).json() == {
        "predictions": [3.5, 4.0, 5.5]}
    assert post(server, "/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress",
                                                                "examples": [{"x": 1.0}, {"x": 2.0}]}).json() == {
        "results": [3.5, 4.0]}
    assert_y(stub.Predict(predict_x("half_plus_three", 2.0), TIMEOUT_S), 4.0, model="half_plus_three")
    metadata = requests.get(server.url + "/v1/models/half_plus_three/metadata", timeout=TIMEOUT_S).json()
    x = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["x"]
    assert x == {"dtype": "DT_FLOAT", "tensor_shape": {"dim": [], "unknown_rank": False}, "name": "x:0"}


def test_two_versions_serve_the_newest_as_tf_servings_default_policy(server, stub):
    status = requests.get(server.url + "/v1/models/half_plus_two_2_versions", timeout=TIMEOUT_S).json()
    assert [entry["version"] for entry in status["model_version_status"]] == [str(VERSION + 1)]
    assert_y(stub.Predict(predict_x("half_plus_two_2_versions", 2.0), TIMEOUT_S), 3.0,
             model="half_plus_two_2_versions", version=VERSION + 1)


# -- TF2 exports -----------------------------------------------------------------------------


def test_tf2_half_plus_two_predicts_over_its_fixed_shape_signature(stub, server):
    """Its serving_default takes shape [1] (no batch dimension), as TF Serving's TF2 model does."""
    assert_y(stub.Predict(predict_x("half_plus_two_tf2", 2.0), TIMEOUT_S), 3.0, model="half_plus_two_tf2")
    metadata = requests.get(server.url + "/v1/models/half_plus_two_tf2/metadata", timeout=TIMEOUT_S).json()
    signatures = metadata["metadata"]["signature_def"]["signature_def"]
    assert signatures["serving_default"]["inputs"] == {"x": {"dtype": "DT_FLOAT", "tensor_shape": dims(1),
                                                             "name": "serving_default_x:0"}}
    assert signatures["regress_x_to_y"]["inputs"]["inputs"] == {"dtype": "DT_STRING", "tensor_shape": dims(-1),
                                                                "name": "regress_x_to_y_inputs:0"}
    assert sorted(signatures) == ["classify_x2_to_y3", "classify_x_to_y", "regress_x2_to_y3", "regress_x_to_y",
                                  "regress_x_to_y2", "serving_default"]


def test_counter_signatures_without_inputs(server):
    """export_counter.py's model: stateful signatures that take no input and answer a scalar."""
    def call(signature: str, inputs: dict | None = None) -> float:
        answer = post(server, "/v1/models/counter:predict", {"signature_name": signature, "inputs": inputs or {}})
        return answer.json()["outputs"]

    assert call("reset_counter") == 0.0
    assert call("incr_counter") == 1.0
    assert call("incr_counter_by", {"delta": 3.0}) == 4.0
    assert call("get_counter") == 4.0


def test_readyz_names_the_signatures_served_unbatched(server):
    """Signatures without a batch dimension on every input and output run one request per call."""
    served = requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()["models"]
    assert served["counter"]["unbatched_signatures"] == ["get_counter", "incr_counter", "incr_counter_by",
                                                         "reset_counter"]
    assert served["multiple_signatures"]["unbatched_signatures"] == ["custom_signature_key", "serving_default"]
    # Over serialized tf.Examples of unknown rank: no batch dimension to stack on.
    assert served["default"]["unbatched_signatures"] == ["classify_x_to_y", "regress_x_to_y", "regress_x_to_y2"]


def test_counter_and_scalar_signatures_load_and_are_described(server):
    """They load and are described as the SignatureDef declares them. The
    output fetches a reference variable: TF Serving's metadata copies DT_FLOAT_REF from the
    SignatureDef; this server names the dtype the answer has."""
    counter = requests.get(server.url + "/v1/models/counter/metadata", timeout=TIMEOUT_S).json()
    signatures = counter["metadata"]["signature_def"]["signature_def"]
    assert signatures["incr_counter_by"] == signature_document(
        "predict", {"delta": ("DT_FLOAT", UNKNOWN_RANK, "delta:0")},
        {"output": ("DT_FLOAT", dims(), "incr_counter_by_op/AssignAdd:0")})
    assert signatures["get_counter"]["inputs"] == {}


# -- a model that cannot load ----------------------------------------------------------------


def test_bad_half_plus_two_is_refused_at_start_with_the_reason(tfs_models, start_server):  # noqa: F811
    """TF Serving keeps running and answers FAILED_PRECONDITION for it; this server refuses to
    start with a model it cannot load, naming why."""
    with pytest.raises(models.ModelLoadError, match="holds no saved_model.pb or saved_model.pbtxt"):
        models.load_model(str(tfs_models["bad_half_plus_two"]), name="bad")
    with pytest.raises(RuntimeError, match="holds no saved_model.pb or saved_model.pbtxt"):
        start_server({"MODEL_PATH": str(tfs_models["bad_half_plus_two"])})


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


# -- loading, without a server ---------------------------------------------------------------


def test_tf1_half_plus_three_loads_through_a_session_where_saved_model_load_fails(tfs_models):  # noqa: F811
    """tf.saved_model.load rebuilds the signature from its declared scalar shape and fails;
    a v1 session on the MetaGraph feeds the batch as TF Serving's C++ session does."""
    import tensorflow as tf

    path = str(tfs_models["half_plus_three"] / f"{VERSION:08d}")
    # TF Serving's own copy fails with "Shape must be rank 1 but is rank 0 for ParseExample";
    # this one with that, or on the rank of y, whichever signature is rebuilt first.
    with pytest.raises(ValueError, match=r"Shape must be rank 1 but is rank 0 for .*ParseExample|"
                                         r"Shapes must be equal rank, but are 2 and 0"):
        tf.saved_model.load(path)
    model = models.load_model(path, name="half_plus_three")
    answer = model.signatures["serving_default"].predict({"x": np.array([1.0, 2.0, 5.0], np.float32)})
    np.testing.assert_array_equal(answer["y"], np.array([3.5, 4.0, 5.5], np.float32))


@pytest.mark.parametrize("name, batchable", [
    ("half_plus_two", {"serving_default": True, "regress_x2_to_y3": True, "classify_x_to_y": False,
                       "regress_x_to_y": False, "regress_x_to_y2": False}),
    ("half_plus_three", {"serving_default": False, "tensorflow/serving/regress": False}),
    ("half_plus_two_tf2", {"serving_default": False, "regress_x2_to_y3": False, "classify_x2_to_y3": False,
                           "regress_x_to_y": True, "regress_x_to_y2": True, "classify_x_to_y": True}),
    ("counter", {"get_counter": False, "incr_counter": False, "incr_counter_by": False, "reset_counter": False}),
    ("tf_saved_model_save", {"serving_default": False}),
])
def test_each_signature_says_whether_it_can_be_batched(tfs_models, name, batchable):  # noqa: F811
    """Batchable: every input and output has a leading dimension of any size (known rank)."""
    model = models.load_model(str(tfs_models[name]), name=name)
    assert {key: signature.batchable for key, signature in model.signatures.items()} == batchable


def test_a_signature_without_inputs_or_with_an_unbatched_output_cannot_be_batched():
    """Nothing to stack (export_counter.py's get_counter), or nothing to slice rows back from."""
    output = models.TensorInfo("y", (), np.dtype("float32"), "DT_FLOAT")
    assert output.batched
    assert not models.Signature("get", models.PREDICT_METHOD, [], [output], lambda batch: {}).batchable
    assert models.Signature("f", models.PREDICT_METHOD, [output], [output], lambda batch: {}).batchable
    scalar = models.TensorInfo("total", (), np.dtype("float32"), "DT_FLOAT", dims=())  # one value per call
    assert not models.Signature("sum", models.PREDICT_METHOD, [output], [scalar], lambda batch: {}).batchable


def test_a_tensor_of_unknown_rank_takes_rows_of_any_shape():
    spec = models.TensorInfo("x", (), np.dtype("float32"), "DT_FLOAT", dims=None)
    fixed = models.TensorInfo("x", (1,), np.dtype("float32"), "DT_FLOAT")
    assert (spec.unknown_rank, spec.batched, fixed.dims, fixed.batched) == (True, False, (None, 1), True)
    assert spec.accepts_row_shape(()) and spec.accepts_row_shape((3, 2))
    assert fixed.accepts_row_shape((1,)) and not fixed.accepts_row_shape((3, 2))


# -- the tensorflow_model_server command -----------------------------------------------------


def test_the_command_refuses_an_unknown_flag_naming_it(tmp_path):
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "app.tfs_flags", "--model_base_path=/m", "--no_such_flag=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    assert done.returncode == 1
    assert done.stderr.strip() == "tensorflow_model_server flags: unknown flag --no_such_flag: " \
                                  "tensorflow_model_server has no such flag"


def test_metadata_of_the_loaded_models_without_a_server(tfs_models):  # noqa: F811
    """The same documents as the served ones, from app.metadata directly (REST JSON and gRPC proto)."""
    from google.protobuf import json_format

    from app import metadata

    model = models.load_model(str(tfs_models["half_plus_two"]), name="default")
    assert metadata.describe(model)["metadata"]["signature_def"]["signature_def"] == HALF_PLUS_TWO_SIGNATURES
    regress = json_format.MessageToDict(metadata.signature_def(model.signatures["regress_x_to_y"]))
    assert regress == {"inputs": {"inputs": {"name": "tf_example:0", "dtype": "DT_STRING",
                                             "tensorShape": {"unknownRank": True}}},
                       "outputs": {"outputs": {"name": "y:0", "dtype": "DT_FLOAT",
                                               "tensorShape": {"dim": [{"size": "-1"}, {"size": "1"}]}}},
                       "methodName": "tensorflow/serving/regress"}
    counter = models.load_model(str(tfs_models["counter"]), name="counter")
    output = metadata.describe(counter)["metadata"]["signature_def"]["signature_def"]["incr_counter"]["outputs"]
    assert output == {"output": {"dtype": "DT_FLOAT", "tensor_shape": dims(), "name": "incr_counter_op/AssignAdd:0"}}


def test_a_rank_one_tensor_for_an_input_declared_minus_one_by_one_is_rows_of_one_value():
    from tensorflow.core.framework import tensor_pb2

    from app import tensor_proto

    spec = models.TensorInfo("x", (1,), np.dtype("float32"), "DT_FLOAT")
    proto = tensor_pb2.TensorProto(dtype=1, float_val=[2.0, 3.0])
    proto.tensor_shape.dim.add().size = 2
    decoded = tensor_proto.to_ndarray(proto, spec, "inputs['x']", max_rows=8, max_bytes=1024)
    np.testing.assert_array_equal(decoded, np.array([[2.0], [3.0]], np.float32))
    wider = models.TensorInfo("x", (2,), np.dtype("float32"), "DT_FLOAT")
    with pytest.raises(Exception, match=r"must have shape \[2\]; the tensor has shape \[2\], rows of shape \[\]"):
        tensor_proto.to_ndarray(proto, wider, "inputs['x']", max_rows=8, max_bytes=1024)


def test_warm_up_leaves_unbatchable_signatures_alone(tfs_models):  # noqa: F811
    """Warm-up runs placeholder rows through batchable signatures only: a fixed-shape one cannot
    take a bucket of rows, and one may change state (export_counter.py's incr_counter)."""
    model = models.load_model(str(tfs_models["half_plus_two_tf2"]), name="tf2")
    called = []

    def recorded(key, run):
        def predict(batch):
            called.append(key)
            return run(batch)

        return predict

    for key, signature in model.signatures.items():
        signature.predict = recorded(key, signature.predict)
    models.warm_up(model, [1, 4])
    assert sorted(set(called)) == ["classify_x_to_y", "regress_x_to_y", "regress_x_to_y2"]
