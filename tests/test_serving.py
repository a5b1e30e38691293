"""The request layer's policy, by plain calls: no server, no TensorFlow model.

Which model, version, label and signature a request names (and TF Serving's words when it
names none), the row and byte limits, the deadline, the shape of classify and regress
answers, and the one request record behind the access log and the request metrics.
Every front door (tests/test_grpc.py, test_tf_serving.py, test_signatures.py...) goes
through these same calls; those files check the wire formats around them.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from app.core import services
from app.core.batching import Batcher, check_rows
from app.core.call import Call, Exchange, ModelSpec
from app.core.errors import (
    BadRequest,
    DeadlineExceeded,
    InvalidInput,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    SignatureNotFound,
)
from app.core.exchange import Exchanges
from app.core.models import (
    CLASSIFY_METHOD,
    DEFAULT_SIGNATURE,
    PREDICT_METHOD,
    REGRESS_METHOD,
    STRING,
    LoadedModel,
    Signature,
    TensorInfo,
)
from app.core.registry import ModelRegistry, Servable
from app.core.serving import RequestLayer
from app.ops import logs
from app.ops.metrics import Metrics
from app.ops.settings import Settings
from app.wire import classify
from app.wire.classify import examples_decode

TIMEOUT_S = 30.0
MAX_REQUEST_ROWS = 4
X = TensorInfo("x", (2,), np.dtype("float32"), "DT_FLOAT")
Y = TensorInfo("y", (), np.dtype("float32"), "DT_FLOAT")
Z = TensorInfo("z", (2,), np.dtype("float32"), "DT_FLOAT")
EXAMPLES = TensorInfo("inputs", (), STRING, "DT_STRING")
CLASSES = TensorInfo("classes", (2,), np.dtype(object), "DT_STRING")
SCORES = TensorInfo("scores", (2,), np.dtype("float32"), "DT_FLOAT")
OUTPUTS = TensorInfo("outputs", (), np.dtype("float32"), "DT_FLOAT")


def _sum_and_double(batch):
    return {"y": batch["x"].sum(axis=1), "z": batch["x"] * 2}


def _examples_model(batch):
    rows = len(batch["inputs"])
    return {"classes": np.array([[b"a", b"b"]] * rows, dtype=object),
            "scores": np.tile(np.array([0.25, 0.75], np.float32), (rows, 1)),
            "outputs": np.arange(rows, dtype=np.float64) + 0.5}


def _servable(version: int, *, with_default: bool = True) -> Servable:
    """Version v of model 'm': serving_default (x -> y, z) and the tf.Example signatures."""
    signatures = {
        "classify": Signature("classify", CLASSIFY_METHOD, [EXAMPLES], [CLASSES, SCORES], _examples_model),
        "regress": Signature("regress", REGRESS_METHOD, [EXAMPLES], [OUTPUTS], _examples_model),
        # A TF2 export's: its method name is predict's, its input and output fit classify.
        "tf2_scores": Signature("tf2_scores", PREDICT_METHOD, [EXAMPLES], [SCORES], _examples_model),
        "takes_floats": Signature("takes_floats", CLASSIFY_METHOD, [X], [Y], _sum_and_double),
    }
    main = "classify"
    if with_default:
        signatures[DEFAULT_SIGNATURE] = Signature(DEFAULT_SIGNATURE, PREDICT_METHOD, [X], [Y, Z], _sum_and_double)
        main = DEFAULT_SIGNATURE
    model = LoadedModel("m", version, "test", signatures[main].inputs, signatures[main].outputs,
                        signatures[main].predict, signatures=signatures)
    batchers = {key: Batcher(signature.predict, name=f"m-v{version}/{key}", max_batch_size=8,
                             max_queue_rows=16, max_request_rows=MAX_REQUEST_ROWS)
                for key, signature in signatures.items()}
    return Servable(model, batchers)


@pytest.fixture
def registry():
    registry = ModelRegistry("m")
    for version in (1, 2):
        registry.add(_servable(version))
    registry.set_labels("m", {"stable": 1})
    yield registry
    registry.close(drain=False)


@pytest.fixture
def metrics():
    return Metrics(CollectorRegistry())


@pytest.fixture
def layer(registry, metrics):
    return RequestLayer(registry, timeout_s=TIMEOUT_S, max_request_bytes=1 << 20)


def _exchange():
    return Exchange("test-request")


def example_signature(layer, servable, name, method):
    """Classify's or regress's signature for `layer`'s method-name check (app/wire/classify.py)."""
    return classify.example_signature(servable.model, name, method, check_method_name=layer.check_method_name)


# -- which model, version, label ------------------------------------------------------------


@pytest.mark.parametrize("spec, version", [
    (ModelSpec(), 2),
    (ModelSpec("m"), 2),
    (ModelSpec("m", 1), 1),
    (ModelSpec("m", label="stable"), 1),
])
def test_a_spec_resolves_to_its_version_and_the_record_names_the_model(layer, spec, version):
    record = _exchange()

    assert layer.model(spec, record).model.version == version
    assert record.model == "m"


@pytest.mark.parametrize("spec, error, message", [
    (ModelSpec("nope"), NotFound, "Servable not found for request: Latest(nope): no model named 'nope'"),
    (ModelSpec("m", 7), NotFound, "Servable not found for request: Specific(m, 7): model 'm' has no version 7"),
    (ModelSpec("m", label="canary"), BadRequest, "Unrecognized servable version label: canary"),
])
def test_an_unknown_model_version_or_label_is_refused_in_tf_servings_words(layer, spec, error, message):
    record = _exchange()

    with pytest.raises(error) as raised:
        layer.model(spec, record)

    assert type(raised.value) is error
    assert raised.value.message.startswith(message)
    assert record.model is None


def test_pinned_means_a_version_or_a_label():
    assert [ModelSpec().pinned, ModelSpec("m").pinned, ModelSpec("m", 1).pinned,
            ModelSpec("m", label="stable").pinned] == [False, False, True, True]


def test_model_status_without_a_name_is_the_default_models(layer):
    assert [entry["version"] for entry in layer.model_status(ModelSpec())] == ["2", "1"]
    assert [entry["version"] for entry in layer.model_status(ModelSpec("m", label="stable"))] == ["1"]


# -- which signature ------------------------------------------------------------------------


def test_an_empty_predict_signature_name_is_serving_default(layer, registry):
    servable = registry.get("m")

    assert layer.predict_signature(servable, "").name == DEFAULT_SIGNATURE
    assert layer.predict_signature(servable, "takes_floats").name == "takes_floats"


def test_an_unknown_predict_signature_carries_its_key(layer, registry):
    with pytest.raises(SignatureNotFound) as raised:
        layer.predict_signature(registry.get("m"), "train")

    assert raised.value.key == "train"
    assert raised.value.message.startswith('Serving signature name: "train" not found in signature def')


@pytest.mark.parametrize("name, method, expected", [
    ("classify", classify.CLASSIFY, ("classify", "inputs")),
    ("regress", classify.REGRESS, ("regress", "inputs")),
    ("tf2_scores", classify.CLASSIFY, ("tf2_scores", "inputs")),
])
def test_an_example_signature_and_its_one_input(layer, registry, name, method, expected):
    signature, input_name = example_signature(layer, registry.get("m"), name, method)

    assert (signature.name, input_name) == expected


def test_without_serving_default_an_unnamed_example_signature_is_the_models_main_one(layer, registry):
    registry.add(_servable(3, with_default=False))

    signature, _ = example_signature(layer, registry.get("m", 3), "", classify.CLASSIFY)

    assert signature.name == "classify"


@pytest.mark.parametrize("name, method, message", [
    ("nope", classify.CLASSIFY, "No signature was found with the name: nope"),
    ("", classify.CLASSIFY, "No classification inputs found in SignatureDef 'serving_default': its input is 'x', "
                           "not 'inputs'"),
    ("classify", classify.REGRESS, "Expected one output Tensor."),
    ("regress", classify.CLASSIFY, 'Expected classification signature outputs to contain at least one of "classes" '
                                  'or "scores". Signature \'regress\' has {outputs}'),
    ("tf2_scores", classify.REGRESS, "No regression outputs found in SignatureDef 'tf2_scores': its output is "
                                    "{scores}, not 'outputs'"),
    ("takes_floats", classify.REGRESS, "No regression inputs found in SignatureDef 'takes_floats': its input is 'x', "
                                      "not 'inputs'"),
])
def test_a_signature_that_does_not_fit_is_refused_in_tf_servings_words(layer, registry, name, method, message):
    """TF Serving's default (no method-name check): the signature's inputs and outputs decide."""
    with pytest.raises(BadRequest) as raised:
        example_signature(layer, registry.get("m"), name, method)

    assert raised.value.message == message


@pytest.mark.parametrize("name, method, message", [
    ("", classify.CLASSIFY, ("Expected classification signature method_name to be tensorflow/serving/classify. "
                            "Was: tensorflow/serving/predict")),
    ("tf2_scores", classify.CLASSIFY, ("Expected classification signature method_name to be "
                                      "tensorflow/serving/classify. Was: tensorflow/serving/predict")),
    ("classify", classify.REGRESS, ("Expected regression signature method_name to be tensorflow/serving/regress. "
                                   "Was: tensorflow/serving/classify")),
])
def test_with_the_method_name_check_a_signature_must_say_its_method(registry, metrics, name, method, message):
    checking = RequestLayer(registry, timeout_s=TIMEOUT_S, max_request_bytes=1 << 20,
                            check_method_name=True)

    with pytest.raises(BadRequest) as raised:
        example_signature(checking, registry.get("m"), name, method)

    assert raised.value.message == message
    assert example_signature(checking, registry.get("m"), "classify", classify.CLASSIFY)[0].name == "classify"


def test_outputs_asked_for_come_in_the_order_asked(layer, registry):
    signature = registry.get("m").model.signatures[DEFAULT_SIGNATURE]

    assert [spec.name for spec in layer.select_outputs(signature)] == ["y", "z"]
    assert [spec.name for spec in layer.select_outputs(signature, ["z", "y"])] == ["z", "y"]


@pytest.mark.parametrize("names, message", [
    (["w"], "output tensor alias not found in signature: w Outputs expected to be in the set {y,z}."),
    (["y", "y"], "duplicate output tensor alias: y"),
])
def test_unknown_or_repeated_outputs_are_refused(layer, registry, names, message):
    with pytest.raises(InvalidInput) as raised:
        layer.select_outputs(registry.get("m").model.signatures[DEFAULT_SIGNATURE], names)

    assert raised.value.message == message


# -- limits -----------------------------------------------------------------------------------


def test_rows_up_to_the_limit_pass_and_one_more_is_refused(layer, registry):
    limit = registry.get("m").batcher.info.max_request_rows

    assert limit == MAX_REQUEST_ROWS
    assert check_rows(limit, limit) == limit
    with pytest.raises(PayloadTooLarge) as raised:
        check_rows(limit + 1, limit, unit="examples")
    assert raised.value.message == ("the request holds 5 examples; this model takes at most 4 rows per request "
                                    "(MAX_REQUEST_ROWS)")


def test_the_byte_limit_comes_from_settings_not_from_flask(registry):
    # No Flask app is involved at all: tests/test_structure.py holds app/core to that.
    served = services.start(Settings(max_request_bytes=12345, request_timeout_ms=250), registry=registry)
    layer = served.layer

    assert (layer.max_request_bytes, layer.timeout_s) == (12345, 0.25)
    assert served.registry is registry


# -- the deadline -----------------------------------------------------------------------------


@pytest.mark.parametrize("client_s, expected_s", [(None, TIMEOUT_S), (5.0, 5.0), (TIMEOUT_S + 60, TIMEOUT_S)])
def test_the_clients_deadline_caps_the_servers(layer, client_s, expected_s):
    assert layer.deadline_s(client_s) == expected_s


@pytest.mark.parametrize("client_s", [0.0, -0.5])
def test_a_deadline_already_passed_is_refused_before_queueing(layer, registry, client_s):
    servable = registry.get("m")
    signature = servable.model.signatures[DEFAULT_SIGNATURE]
    record = _exchange()

    with pytest.raises(DeadlineExceeded, match="deadline passed before it was queued"):
        layer.run(Call.within(layer.deadline_s(client_s), exchange=record), servable, signature,
                  lambda _signature, _rows: {"x": np.ones((1, 2), np.float32)})
    assert servable.batchers[DEFAULT_SIGNATURE].batches_run == 0


# -- predictions, classify and regress ------------------------------------------------------


def test_a_prediction_answers_its_rows_and_fills_the_record(layer, registry):
    servable = layer.model(ModelSpec("m", 1))
    signature = layer.predict_signature(servable, "")
    record = _exchange()
    x = np.array([[1, 2], [3, 4]], np.float32)

    answer = layer.infer(Call.within(layer.deadline_s(), model=ModelSpec("m", 1), exchange=record),
                         lambda _signature, _rows: {"x": x})

    assert answer.servable is servable and answer.signature is signature
    np.testing.assert_array_equal(answer.outputs["y"], [3, 7])
    np.testing.assert_array_equal(answer.outputs["z"], x * 2)
    assert (record.rows, record.batch_rows, record.batch_requests) == (2, 2, 1)


def test_classify_answers_labels_and_scores_per_example(layer, registry):
    record = _exchange()
    examples = np.array([b"e1", b"e2", b"e3"], dtype=object)

    call = Call.within(layer.deadline_s(), model=ModelSpec("m"), signature="classify", exchange=record)
    answer, classes = classify.classify(layer, call, examples_decode(lambda _rows: examples))

    assert answer.signature.name == "classify" and record.rows == 3
    assert classes.labels == [["a", "b"]] * 3
    assert classes.scores.dtype == np.float32
    np.testing.assert_array_equal(classes.scores, [[0.25, 0.75]] * 3)


def test_regress_answers_one_float32_per_example(layer, registry):
    call = Call.within(layer.deadline_s(), model=ModelSpec("m"), signature="regress", exchange=_exchange())
    answer, values = classify.regress(layer, call,
                                      examples_decode(lambda _rows: np.array([b"e1", b"e2"], dtype=object)))

    assert answer.signature.name == "regress"
    assert values.dtype == np.float32
    np.testing.assert_array_equal(values, [0.5, 1.5])


def test_classes_fill_in_what_the_model_leaves_out():
    only_scores = classify.classes({"scores": np.array([[0.5, 0.5]], np.float64)}, 1)
    only_labels = classify.classes({"classes": np.array([[b"x", b"\xff"]], dtype=object)}, 1)

    assert (only_scores.labels, only_scores.scores.tolist()) == ([["", ""]], [[0.5, 0.5]])
    assert (only_labels.labels, only_labels.scores.tolist()) == ([["x", "\ufffd"]], [[0.0, 0.0]])


@pytest.mark.parametrize("outputs, rows, message", [
    ({"logits": np.zeros((2, 2))}, 2, "Expected classification signature outputs to contain 'classes' or 'scores'"),
])
def test_a_classify_answer_without_classes_or_scores_is_refused(outputs, rows, message):
    with pytest.raises(BadRequest, match=message):
        classify.classes(outputs, rows)


def test_a_regress_answer_of_the_wrong_size_is_refused():
    with pytest.raises(BadRequest) as raised:
        classify.regressions({"outputs": np.zeros((2, 2))}, 2)

    assert raised.value.message == "Expected output Tensor shape to be [2] or [2, 1]; got [2, 2]"
    np.testing.assert_array_equal(classify.regressions({"other": np.array([[1.0], [2.0]])}, 2), [1.0, 2.0])


# -- one record: access line and metrics ----------------------------------------------------


def test_one_record_feeds_the_access_line_and_the_request_metrics(metrics, caplog, monkeypatch):
    # An app built in this process with ACCESS_LOG off turns the logger off process-wide.
    monkeypatch.setattr(logs.access_log, "disabled", False)
    exchanges = Exchanges(metrics)
    route = "/tensorflow.serving.PredictionService/Predict"
    record = exchanges.open(Exchange("rid-1", "GRPC", route, route=route))
    assert metrics.registry.get_sample_value("model_server_requests_in_flight") == 1
    record.model, record.rows, record.batch_rows, record.batch_requests = "m", 2, 8, 3
    record.status = "NOT_FOUND"

    with caplog.at_level(logging.INFO, logger="app.access"):
        exchanges.close(record)
        logs.flush_access_log()

    labels = {"route": "/tensorflow.serving.PredictionService/Predict", "method": "GRPC", "status": "NOT_FOUND"}
    assert metrics.registry.get_sample_value("model_server_requests_total", labels) == 1
    assert metrics.registry.get_sample_value("model_server_request_duration_seconds_count",
                                             {"route": labels["route"]}) == 1
    assert metrics.registry.get_sample_value("model_server_requests_in_flight") == 0
    [line] = [entry.fields for entry in caplog.records if entry.name == "app.access"]
    assert line.pop("latency_ms") >= 0
    assert line == {"method": "GRPC", "path": labels["route"], "status": "NOT_FOUND", "rows": 2, "batch_rows": 8,
                    "batch_requests": 3, "model": "m", "request_id": "rid-1"}


# -- MultiInference ---------------------------------------------------------------------------------


def test_multi_inference_answers_every_task_in_order_from_one_version(layer, registry):
    tasks = [classify.Task("m", "regress", REGRESS_METHOD), classify.Task("m", "classify", CLASSIFY_METHOD)]
    record = _exchange()

    call = Call.within(layer.deadline_s(), model=ModelSpec("m"), exchange=record)
    servable, results = classify.multi_inference(layer, call, tasks,
                                                 examples_decode(lambda _rows: np.array([b"e1", b"e2"], dtype=object)))

    assert servable.model.version == 2 and record.rows == 2
    assert [result.signature.name for result in results] == ["regress", "classify"]
    np.testing.assert_array_equal(results[0].regressions, [0.5, 1.5])
    assert results[0].classes is None and results[1].regressions is None
    assert results[1].classes.labels == [["a", "b"]] * 2


@pytest.mark.parametrize("tasks, error, message", [
    ([("m", "regress", REGRESS_METHOD), ("m", "regress", REGRESS_METHOD)], BadRequest,
     "Duplicate evaluation of signature: regress"),
    ([("m", "regress", REGRESS_METHOD), ("other", "classify", CLASSIFY_METHOD)], BadRequest,
     "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    ([("m", "regress", REGRESS_METHOD), ("m", "classify", PREDICT_METHOD)], MethodNotAllowed,
     "Unsupported signature method_name: tensorflow/serving/predict"),
    ([("m", "regress", REGRESS_METHOD), ("m", "train", CLASSIFY_METHOD)], BadRequest,
     "Requested signature not found in model graph: train"),
])
def test_multi_inference_runs_no_task_unless_every_task_passes(layer, registry, tasks, error, message):
    servable = registry.get("m")

    with pytest.raises(error) as raised:
        classify.multi_inference(layer, Call.within(layer.deadline_s(), model=ModelSpec("m"), exchange=_exchange()),
                                 [classify.Task(*task) for task in tasks],
                                 examples_decode(lambda _rows: np.array([b"e1"], dtype=object)))

    assert raised.value.message == message
    assert servable.batchers["regress"].batches_run == 0


def test_a_multi_inference_runs_on_its_first_tasks_model_which_must_be_named():
    assert classify.multi_inference_spec(ModelSpec("m", 3)) == ModelSpec("m", 3)
    with pytest.raises(BadRequest, match="ModelSpec has no name specified."):
        classify.multi_inference_spec(ModelSpec())
