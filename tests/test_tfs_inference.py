"""Classify, Regress and MultiInference as TensorFlow Serving 2.x answers them, and warm-up.

Against live servers (`gunicorn -c gunicorn.conf.py wsgi:app`), over REST and gRPC with
TensorFlow Serving's own stubs. The model is a TF2 `tf.saved_model.save` export, as TF
Serving's saved_model_half_plus_two_tf2 is: every signature's method name is
tensorflow/serving/predict, so Classify and Regress take any signature whose input is
'inputs' (serialized tf.Examples) and whose outputs are 'classes'/'scores' or 'outputs'
(servables/tensorflow/classifier.cc, regressor.cc), unless ENABLE_SIGNATURE_METHOD_NAME_CHECK
(--enable_signature_method_name_check) is on. MultiInference follows multi_inference.cc.
tensorflow_model_server_test.py's testClassifyTf2, testRegressTf2 and testMultiInferenceTf2
have their counterparts in test_tfs_model_server.py; these tests go further.
"""

from __future__ import annotations

import json
import shutil
import types

import grpc
import numpy as np
import pytest
import requests
from tensorflow_serving.apis import (
    classification_pb2,
    get_model_status_pb2,
    inference_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_log_pb2,
    prediction_service_pb2_grpc,
    regression_pb2,
)

from tests.conftest import Server, wait_for

TIMEOUT_S = 60
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"


def save_half_plus_two_tf2(path) -> None:
    """y = 0.5 x + 2 behind TF2 signatures of every kind TF Serving's Classify and Regress meet.

    `total` sums every x the model is given (warm-up's bucket batches give zeros): `peek`
    reads it, so a replayed warm-up request is seen in the model's own state.
    """
    import tensorflow as tf

    examples = tf.TensorSpec([None], tf.string, name="inputs")

    class HalfPlusTwo(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.total = tf.Variable(0.0)

        def _x(self, inputs):
            # A default, so that the bucket warm-up's empty examples parse.
            x = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32, [0.0])})["x"]
            self.total.assign_add(tf.reduce_sum(x))
            return x

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def predict(self, x):
            self.total.assign_add(tf.reduce_sum(x))
            return {"y": 0.5 * x + 2.0}

        @tf.function(input_signature=[examples])
        def classify_x_to_y(self, inputs):
            return {"scores": 0.5 * self._x(inputs) + 2.0}

        @tf.function(input_signature=[examples])
        def regress_x_to_y(self, inputs):
            return {"outputs": 0.5 * self._x(inputs) + 2.0}

        @tf.function(input_signature=[examples])
        def classify_labels(self, inputs):
            y = 0.5 * self._x(inputs) + 2.0
            return {"classes": tf.tile(tf.constant([["low", "high"]]), [tf.shape(y)[0], 1]),
                    "scores": tf.concat([-y, y], axis=1)}

        @tf.function(input_signature=[examples])
        def two_outputs(self, inputs):
            y = 0.5 * self._x(inputs) + 2.0
            return {"outputs": y, "scores": y}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
        def examples_input(self, examples):
            return {"outputs": 0.5 * self._x(examples) + 2.0}

        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def peek(self, x):
            return {"total": tf.fill(tf.shape(x), self.total)}

    model = HalfPlusTwo()
    tf.saved_model.save(model, str(path), signatures={
        "serving_default": model.predict, "classify_x_to_y": model.classify_x_to_y,
        "regress_x_to_y": model.regress_x_to_y, "classify_labels": model.classify_labels,
        "two_outputs": model.two_outputs, "examples_input": model.examples_input, "peek": model.peek})


def example_input(xs: list[float], target) -> None:
    """tf.Examples with one float feature x each, into a tensorflow.serving.Input."""
    for x in xs:
        target.example_list.examples.add().features.feature["x"].float_list.value.append(x)


def classify_request(model: str, signature: str, xs: list[float]):
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name, request.model_spec.signature_name = model, signature
    example_input(xs, request.input)
    return request


def regress_request(model: str, signature: str, xs: list[float]):
    request = regression_pb2.RegressionRequest()
    request.model_spec.name, request.model_spec.signature_name = model, signature
    example_input(xs, request.input)
    return request


def multi_request(model: str, tasks: list[tuple[str, str]], xs: list[float], *, names: list[str] | None = None):
    request = inference_pb2.MultiInferenceRequest()
    for index, (signature, method) in enumerate(tasks):
        task = request.tasks.add()
        task.model_spec.name = model if names is None else names[index]
        task.model_spec.signature_name = signature
        task.method_name = method
    example_input(xs, request.input)
    return request


def predict_request(model: str, signature: str, x: list[float]):
    import tensorflow as tf

    request = predict_pb2.PredictRequest()
    request.model_spec.name, request.model_spec.signature_name = model, signature
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array(x, np.float32)))
    return request


def write_warmup(model_dir, records) -> None:
    """assets.extra/tf_serving_warmup_requests, a TFRecord of PredictionLogs, as TF Serving reads it."""
    import tensorflow as tf

    folder = model_dir / "assets.extra"
    folder.mkdir()
    with tf.io.TFRecordWriter(str(folder / "tf_serving_warmup_requests")) as writer:
        for record in records:
            writer.write(record.SerializeToString())


def warmup_records(model: str) -> list:
    """One record of each kind; the x they carry add up to 3 + 10 + 100 + 2 * 1000 = 2113."""
    predict = prediction_log_pb2.PredictionLog()
    predict.predict_log.request.CopyFrom(predict_request(model, "", [1.0, 2.0]))
    classify = prediction_log_pb2.PredictionLog()
    classify.classify_log.request.CopyFrom(classify_request(model, "classify_x_to_y", [10.0]))
    regress = prediction_log_pb2.PredictionLog()
    regress.regress_log.request.CopyFrom(regress_request(model, "regress_x_to_y", [100.0]))
    multi = prediction_log_pb2.PredictionLog()
    multi.multi_inference_log.request.CopyFrom(multi_request(
        model, [("regress_x_to_y", REGRESS_METHOD), ("classify_x_to_y", CLASSIFY_METHOD)], [1000.0]))
    return [predict, classify, regress, multi]


WARMUP_TOTAL = 2113.0


def failing_warmup_record(model: str):
    """A regress on a signature the model has not: TF Serving fails the version's load on it."""
    record = prediction_log_pb2.PredictionLog()
    record.regress_log.request.CopyFrom(regress_request(model, "no_such_signature", [1.0]))
    return record


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tfs_inference")
    save_half_plus_two_tf2(folder / "tf2")
    shutil.copytree(folder / "tf2", folder / "warm")
    write_warmup(folder / "warm", warmup_records("anything"))  # the record's model name is not used
    shutil.copytree(folder / "tf2", folder / "versions" / "1")
    return folder


@pytest.fixture(scope="module")
def served(folder):
    config = folder / "models.json"
    config.write_text(json.dumps({"models": [
        {"name": "tf2", "path": str(folder / "tf2")},
        {"name": "warm", "path": str(folder / "warm")},
        {"name": "versions", "path": str(folder / "versions")},
    ]}))
    server = Server(folder, {"MODEL_CONFIG": str(config), "MODEL_POLL_SECONDS": "0.5", "LOG_FORMAT": "json"})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.grpc_target) as channel:
        yield prediction_service_pb2_grpc.PredictionServiceStub(channel)


def post(server: Server, path: str, body) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


# -- Classify and Regress on a TF2 SavedModel ------------------------------------------------------


def test_classify_tf2_answers_labels_and_scores(stub):
    response = stub.Classify(classify_request("tf2", "classify_labels", [2.0, 6.0]), timeout=TIMEOUT_S)

    assert [[(c.label, c.score) for c in row.classes] for row in response.result.classifications] == [
        [("low", -3.0), ("high", 3.0)], [("low", -5.0), ("high", 5.0)]]


def test_classify_and_regress_tf2_over_rest(served):
    """testClassifyREST and testRegressREST, on the TF2 model's signatures."""
    classify = post(served, "/v1/models/tf2:classify", {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]})
    regress = post(served, "/v1/models/tf2:regress", {"signature_name": "regress_x_to_y", "examples": [{"x": 2.0}]})

    assert classify.status_code == 200, classify.text
    assert classify.json() == {"results": [[["", 3.0]]]}
    assert regress.json() == {"results": [3.0]}


# What TF Serving answers with the method-name check off (its default): the signature's shape decides.
SHAPE_REFUSALS = [
    ("Regress", "classify_labels", "Expected one output Tensor."),
    ("Classify", "", "No classification inputs found in SignatureDef 'serving_default'"),
    ("Regress", "examples_input", "No regression inputs found in SignatureDef 'examples_input'"),
    ("Regress", "classify_x_to_y", "No regression outputs found in SignatureDef 'classify_x_to_y'"),
    ("Classify", "regress_x_to_y", 'Expected classification signature outputs to contain at least one of "classes" '
                                   'or "scores"'),
    ("Classify", "nope", "No signature was found with the name: nope"),
]


@pytest.mark.parametrize("method, signature, expected", SHAPE_REFUSALS)
def test_a_signature_that_does_not_fit_is_refused_over_grpc(stub, method, signature, expected):
    request = (classify_request if method == "Classify" else regress_request)("tf2", signature, [1.0])

    with pytest.raises(grpc.RpcError) as raised:
        getattr(stub, method)(request, timeout=TIMEOUT_S)

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()


@pytest.mark.parametrize("method, signature, expected", SHAPE_REFUSALS)
def test_a_signature_that_does_not_fit_is_refused_over_rest(served, method, signature, expected):
    answer = post(served, f"/v1/models/tf2:{method.lower()}", {"signature_name": signature, "examples": [{"x": 1.0}]})

    assert answer.status_code == 400
    assert expected in answer.json()["error"]


# -- MultiInference ----------------------------------------------------------------------------------


def test_multi_inference_answers_in_the_tasks_order_for_every_example(stub):
    request = multi_request("tf2", [("classify_labels", CLASSIFY_METHOD), ("regress_x_to_y", REGRESS_METHOD),
                                    ("classify_x_to_y", CLASSIFY_METHOD)], [2.0, 6.0])

    response = stub.MultiInference(request, timeout=TIMEOUT_S)

    assert [result.WhichOneof("result") for result in response.results] == [
        "classification_result", "regression_result", "classification_result"]
    assert [[(c.label, c.score) for c in row.classes]
            for row in response.results[0].classification_result.classifications] == [
        [("low", -3.0), ("high", 3.0)], [("low", -5.0), ("high", 5.0)]]
    assert [entry.value for entry in response.results[1].regression_result.regressions] == [3.0, 5.0]
    assert [[c.score for c in row.classes]
            for row in response.results[2].classification_result.classifications] == [[3.0], [5.0]]


@pytest.mark.parametrize("tasks, names, code, expected", [
    ([("regress_x_to_y", REGRESS_METHOD), ("classify_x_to_y", CLASSIFY_METHOD)], ["tf2", "warm"],
     grpc.StatusCode.INVALID_ARGUMENT, "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    ([("regress_x_to_y", REGRESS_METHOD), ("regress_x_to_y", REGRESS_METHOD)], None,
     grpc.StatusCode.INVALID_ARGUMENT, "Duplicate evaluation of signature: regress_x_to_y"),
    ([("", REGRESS_METHOD)], None,
     grpc.StatusCode.INVALID_ARGUMENT, "No regression inputs found in SignatureDef 'serving_default'"),
    ([("nope", REGRESS_METHOD)], None,
     grpc.StatusCode.INVALID_ARGUMENT, "Requested signature not found in model graph: nope"),
    ([("regress_x_to_y", "tensorflow/serving/predict")], None,
     grpc.StatusCode.UNIMPLEMENTED, "Unsupported signature method_name: tensorflow/serving/predict"),
    ([("regress_x_to_y", REGRESS_METHOD), ("classify_x_to_y", REGRESS_METHOD)], None,
     grpc.StatusCode.INVALID_ARGUMENT, "No regression outputs found in SignatureDef 'classify_x_to_y'"),
    ([("regress_x_to_y", REGRESS_METHOD), ("classify_x_to_y", CLASSIFY_METHOD)], ["tf2", ""],
     grpc.StatusCode.INVALID_ARGUMENT, "Found ModelSpec with an empty model name."),
    ([], None, grpc.StatusCode.INVALID_ARGUMENT, "ModelSpec has no name specified."),
    ([("regress_x_to_y", REGRESS_METHOD)], ["nope"], grpc.StatusCode.NOT_FOUND, "Servable not found for request"),
])
def test_multi_inference_refuses_as_tensorflow_serving_does(stub, tasks, names, code, expected):
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(multi_request("tf2", tasks, [1.0], names=names), timeout=TIMEOUT_S)

    assert raised.value.code() == code
    assert expected in raised.value.details()


def test_multi_inference_without_examples_is_refused(stub):
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(multi_request("tf2", [("regress_x_to_y", REGRESS_METHOD)], []), timeout=TIMEOUT_S)

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input is empty."


def test_multi_inference_is_counted_and_logged_like_other_calls(served, stub):
    route = "/tensorflow.serving.PredictionService/MultiInference"
    before = served.metric("model_server_requests_total", route=route, status="OK")
    request_id = "multi-inference-logged"

    stub.MultiInference(multi_request("tf2", [("regress_x_to_y", REGRESS_METHOD)], [1.0, 2.0]),
                        metadata=(("x-request-id", request_id),), timeout=TIMEOUT_S)

    assert served.metric("model_server_requests_total", route=route, status="OK") == before + 1

    def logged():
        for line in served.log().splitlines():
            if line.startswith("{") and json.loads(line).get("request_id") == request_id:
                return json.loads(line)
        return None

    line = wait_for(logged, what="the access line of the MultiInference call")
    assert (line["path"], line["status"], line["model"], line["rows"]) == (route, "OK", "tf2", 2)


# -- warm-up ---------------------------------------------------------------------------------------------


def test_warmup_records_of_every_kind_are_replayed_before_the_model_serves(served):
    """Predict, classify, regress and multi_inference records each reached the model once before
    the server was ready; the model without a warm-up file saw nothing but zeros."""
    warm = post(served, "/v1/models/warm:predict", {"signature_name": "peek", "instances": [0.0]})
    cold = post(served, "/v1/models/versions:predict", {"signature_name": "peek", "instances": [0.0]})

    assert warm.json() == {"predictions": [WARMUP_TOTAL]}
    assert cold.json() == {"predictions": [0.0]}


def test_a_version_whose_warmup_fails_is_not_served_and_the_last_one_stays(served, folder, stub):
    """As in TF Serving, a failed warm-up record fails the version's load: version 2 ends in END with
    the record's error, and version 1 keeps serving."""
    version_2 = folder / "staging"
    shutil.copytree(folder / "tf2", version_2)
    write_warmup(version_2, [*warmup_records("versions")[:1], failing_warmup_record("versions")])
    version_2.rename(folder / "versions" / "2")
    status_request = get_model_status_pb2.GetModelStatusRequest()
    status_request.model_spec.name = "versions"

    with grpc.insecure_channel(served.grpc_target) as channel:
        status_stub = model_service_pb2_grpc.ModelServiceStub(channel)

        def version_2_ended():
            statuses = status_stub.GetModelStatus(status_request, timeout=TIMEOUT_S).model_version_status
            return next((s for s in statuses
                         if s.version == 2 and s.state == get_model_status_pb2.ModelVersionStatus.END), None)

        ended = wait_for(version_2_ended, within_s=120, what="version 2 to fail its warm-up")
    assert "warm-up record 1 (regress_log)" in ended.status.error_message
    assert "No signature was found with the name: no_such_signature" in ended.status.error_message
    answer = stub.Regress(regress_request("versions", "regress_x_to_y", [2.0]), timeout=TIMEOUT_S)
    assert answer.model_spec.version.value == 1 and [r.value for r in answer.result.regressions] == [3.0]


@pytest.mark.parametrize("content, message", [
    (b"plain text, not a TFRecord file", "Please verify your warmup data is in TFRecord format."),
    (None, "Failed to parse warmup record 0"),
])
def test_a_warmup_file_that_does_not_read_fails_the_load(tmp_path, content, message):
    import tensorflow as tf
    from prometheus_client import CollectorRegistry

    from app.core.models import ModelLoadError
    from app.ops.metrics import Metrics
    from app.ops.settings import Settings
    from app.wire import warmup

    (tmp_path / "assets.extra").mkdir()
    path = tmp_path / "assets.extra" / "tf_serving_warmup_requests"
    if content is None:
        with tf.io.TFRecordWriter(str(path)) as writer:
            writer.write(b"\xff\xff not a PredictionLog")
    else:
        path.write_bytes(content)
    servable = types.SimpleNamespace(model=types.SimpleNamespace(name="m", version=1, source=str(tmp_path)))

    with pytest.raises(ModelLoadError) as raised:
        warmup.replay(servable, Settings(max_request_bytes=1 << 20), Metrics(CollectorRegistry()))

    assert message in str(raised.value)
