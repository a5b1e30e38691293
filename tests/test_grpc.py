"""TensorFlow Serving's gRPC API, driven with the unmodified `tensorflow_serving.apis` stubs.

A live `gunicorn -c gunicorn.conf.py wsgi:app` serves five models: `exact` (integer
weights: served predictions equal the model's own, row for row), `held` (the same model
behind a 6 s batch window and a 4-row queue, so requests can be held queued on purpose),
`tss`, TensorFlow Serving's tag/signal/sensor example (string and float inputs),
`versioned` (two exported versions labelled stable and canary) and `examples` (classify
and regress signatures over serialized tf.Examples).

TensorFlow Serving's answers that the status codes follow: model_servers/predict_util.cc
and predict_impl.cc (INVALID_ARGUMENT for bad inputs and output_filter,
FAILED_PRECONDITION for an unknown signature), get_model_metadata_impl.cc, and
core/server_core.cc (NOT_FOUND for an unknown model or version).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import threading
import time
import uuid

import grpc
import numpy as np
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from tests.conftest import Server, build_exact_model, integer_rows, wait_for
from tests.test_tf_serving import save_tag_signal_sensor

PREDICT = "/tensorflow.serving.PredictionService/Predict"
HELD_WINDOW_MS = 6000
HELD_QUEUE_ROWS = 4
REQUEST_TIMEOUT_MS = 4000
MAX_REQUEST_BYTES = 64 * 1024
EXACT_ROW_LIMIT = 64  # MAX_REQUEST_ROWS 0: 2 x MAX_BATCH_SIZE (32), within MAX_QUEUE_ROWS


def make_tensor_proto(value, **kwargs):
    import tensorflow as tf

    return tf.make_tensor_proto(value, **kwargs)


def make_ndarray(proto) -> np.ndarray:
    import tensorflow as tf

    return tf.make_ndarray(proto)






def access_lines(server: Server) -> list[dict]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith("{") and '"logger":"app.access"' in line:
            lines.append(json.loads(line))
    return lines


def access_line(server: Server, request_id: str) -> dict:
    return wait_for(lambda: next((entry for entry in access_lines(server) if entry["request_id"] == request_id), None),
                    within_s=30, what=f"the access line of {request_id}")


def predict_request(model: str, rows: np.ndarray | None = None, **spec) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    if rows is not None:
        request.inputs["features"].CopyFrom(make_tensor_proto(rows))
    return request


def scores(response) -> np.ndarray:
    return make_ndarray(response.outputs["scores"])


def save_classify_regress(path) -> None:
    """A SavedModel with TF Serving's classify and regress signatures over serialized tf.Examples.

    Built with the TF1 SavedModel builder: it writes the method names (tensorflow/serving/
    classify, .../regress) that TF Serving's Classify and Regress require of a signature.
    classify: classes ["neg", "pos"], scores [-(x0 + x1), x0 + x1]; regress: 2 x0 + x1.
    """
    import tensorflow as tf

    v1 = tf.compat.v1
    with tf.Graph().as_default() as graph, v1.Session(graph=graph) as session:
        serialized = v1.placeholder(tf.string, [None], name="tf_example")
        # A default, because warm-up sends empty strings, which hold no feature.
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([2], tf.float32, [0.0, 0.0])})["x"]
        total = tf.reduce_sum(x, axis=1, keepdims=True)
        classes = tf.tile(tf.constant([["neg", "pos"]]), [tf.shape(x)[0], 1])
        builder = v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(session, [v1.saved_model.tag_constants.SERVING], signature_def_map={
            "classify": v1.saved_model.classification_signature_def(serialized, classes,
                                                                     tf.concat([-total, total], axis=1)),
            "regress": v1.saved_model.regression_signature_def(serialized, 2.0 * x[:, :1] + x[:, 1:]),
        })
        builder.save()


@pytest.fixture(scope="session")
def second_model():
    return build_exact_model(seed=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory, exact_model_path, exact_model, second_model):
    folder = tmp_path_factory.mktemp("grpc")
    tss_path = folder / "tss"
    save_tag_signal_sensor(tss_path)
    save_classify_regress(folder / "examples")
    for version, model in ((1, exact_model), (2, second_model)):
        model.export(str(folder / "versioned" / str(version)), format="tf_saved_model", verbose=False)
    config = folder / "models.json"
    config.write_text(json.dumps({"default": "exact", "models": [
        {"name": "exact", "path": str(exact_model_path)},
        {"name": "held", "path": str(exact_model_path), "batch_timeout_ms": HELD_WINDOW_MS,
         "max_batch_size": 8, "max_queue_rows": HELD_QUEUE_ROWS},
        {"name": "tss", "path": str(tss_path)},
        {"name": "versioned", "path": str(folder / "versioned"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}},
        {"name": "examples", "path": str(folder / "examples")},
    ]}))
    server = Server(folder, {"MODEL_CONFIG": str(config), "LOG_FORMAT": "json", "MODEL_POLL_SECONDS": "0",
                             "REQUEST_TIMEOUT_MS": str(REQUEST_TIMEOUT_MS),
                             "MAX_REQUEST_BYTES": str(MAX_REQUEST_BYTES)})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.grpc_target) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel):
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


# -- predictions ------------------------------------------------------------------------------


def test_predict_answers_the_models_own_output_row_for_row(stub, exact_model):
    rows = integer_rows(7, seed=11)

    response, call = stub.Predict.with_call(predict_request("exact", rows), timeout=30)

    np.testing.assert_array_equal(scores(response), exact_model(rows).numpy())
    # As TensorFlow Serving answers by default (predict_util.cc, kAsProtoField): the typed field.
    assert list(response.outputs["scores"].float_val) == exact_model(rows).numpy().flatten().tolist()
    assert not response.outputs["scores"].tensor_content
    assert (response.model_spec.name, response.model_spec.version.value,
            response.model_spec.signature_name) == ("exact", 1, "serving_default")
    assert dict(call.initial_metadata())["x-request-id"]


@pytest.mark.parametrize("form", ["float_val", "broadcast", "no-model-name"])
def test_predict_reads_typed_fields_as_tensorflow_does(stub, exact_model, form):
    rows = integer_rows(3, seed=12)
    request = predict_request("" if form == "no-model-name" else "exact")
    tensor = request.inputs["features"]
    tensor.dtype = 1  # DT_FLOAT
    for size in (3, 4):
        tensor.tensor_shape.dim.add().size = size
    if form == "broadcast":
        # tf.make_tensor_proto(5.0, shape=[3, 4]) sends one value: it fills the whole tensor.
        tensor.CopyFrom(make_tensor_proto(5.0, shape=[3, 4]))
        assert list(tensor.float_val) == [5.0] and not tensor.tensor_content
        rows = np.full((3, 4), 5.0, np.float32)
    else:
        tensor.float_val.extend(rows.flatten().tolist())

    response = stub.Predict(request, timeout=30)

    np.testing.assert_array_equal(scores(response), exact_model(rows).numpy())


def test_predict_takes_strings_and_several_inputs_and_filters_outputs(stub):
    request = predict_request("tss")
    request.inputs["tag"].CopyFrom(make_tensor_proto([b"foo", "héllo".encode(), b""]))
    request.inputs["signal"].CopyFrom(make_tensor_proto(np.arange(15, dtype=np.float32).reshape(3, 5)))
    sensor = request.inputs["sensor"]
    sensor.dtype = 1
    for size in (3, 2, 2):
        sensor.tensor_shape.dim.add().size = size
    sensor.float_val.extend(range(12))
    request.output_filter.extend(["tag_length", "sensor_max"])

    response = stub.Predict(request, timeout=30)

    assert set(response.outputs) == {"tag_length", "sensor_max"}
    np.testing.assert_array_equal(make_ndarray(response.outputs["tag_length"]), [3, 6, 0])
    np.testing.assert_array_equal(make_ndarray(response.outputs["sensor_max"]), [3.0, 7.0, 11.0])


def test_a_pinned_version_is_served_and_named(stub, exact_model):
    rows = integer_rows(2, seed=13)

    response = stub.Predict(predict_request("exact", rows, version=1), timeout=30)

    assert response.model_spec.version.value == 1
    np.testing.assert_array_equal(scores(response), exact_model(rows).numpy())


# -- status codes -----------------------------------------------------------------------------


def _tensor(dtype: int, shape: list[int], **fields):
    from tensorflow.core.framework import tensor_pb2

    tensor = tensor_pb2.TensorProto(dtype=dtype, **fields)
    for size in shape:
        tensor.tensor_shape.dim.add().size = size
    return tensor


BAD_INPUTS = {
    "wrong-dtype": (lambda r: r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float64))),
                    "takes DT_FLOAT"),
    "wrong-row-shape": (lambda r: r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 5), np.float32))),
                        "must have shape [4]"),
    "no-batch-dimension": (lambda r: r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros(4, np.float32))),
                           "must have shape [4]"),
    "missing-input": (lambda r: None, "Missing but required: {features}"),
    "extra-input": (lambda r: (r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32))),
                               r.inputs["other"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32)))),
                    "Sent extra: {other}"),
    "short-content": (lambda r: r.inputs["features"].CopyFrom(_tensor(1, [2, 4], tensor_content=b"\0" * 12)),
                      "tensor_content holds 12 bytes"),
    "too-many-values": (lambda r: r.inputs["features"].CopyFrom(_tensor(1, [1, 4], float_val=[1.0] * 5)),
                        "float_val holds 5 values"),
    "values-in-another-field": (lambda r: r.inputs["features"].CopyFrom(_tensor(1, [1, 4], int_val=[1, 2, 3, 4])),
                                "not int_val"),
    "no-rows": (lambda r: r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((0, 4), np.float32))),
                "no rows"),
    "over-the-row-limit": (lambda r: r.inputs["features"].CopyFrom(
        make_tensor_proto(np.zeros((EXACT_ROW_LIMIT + 1, 4), np.float32))), "MAX_REQUEST_ROWS"),
    # One value for a billion rows: refused before anything is allocated.
    "a-billion-rows-of-one-value": (lambda r: r.inputs["features"].CopyFrom(_tensor(1, [10**9, 4], float_val=[1.0])),
                                    "MAX_REQUEST_ROWS"),
    "unknown-output-alias": (lambda r: (r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32))),
                                        r.output_filter.append("nope")),
                             "output tensor alias not found in signature: nope"),
    "duplicate-output-alias": (lambda r: (
        r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32))),
        r.output_filter.extend(["scores", "scores"])), "duplicate output tensor alias: scores"),
    "version-label": (lambda r: (r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32))),
                                 setattr(r.model_spec, "version_label", "stable")),
                      "Unrecognized servable version label: stable"),
    "no-model-spec": (lambda r: (r.ClearField("model_spec"),
                                 r.inputs["features"].CopyFrom(make_tensor_proto(np.zeros((1, 4), np.float32)))),
                      "Missing ModelSpec"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument(stub, case):
    change, expected = BAD_INPUTS[case]
    request = predict_request("exact")
    change(request)

    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(request, timeout=30)

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert expected in raised.value.details()


@pytest.mark.parametrize("spec, code, expected", [
    ({"name": "nope"}, grpc.StatusCode.NOT_FOUND, "no model named 'nope'"),
    ({"name": "exact", "version": 7}, grpc.StatusCode.NOT_FOUND, "has no version 7"),
    ({"name": "exact", "signature_name": "classify"}, grpc.StatusCode.FAILED_PRECONDITION,
     'Serving signature key "classify" not found.'),
])
def test_unknown_model_version_or_signature(stub, spec, code, expected):
    # Not spec.pop: the parameters are shared with the model-process copy of this file.
    request = predict_request(spec["name"], np.zeros((1, 4), np.float32),
                              **{key: value for key, value in spec.items() if key != "name"})

    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(request, timeout=30)

    assert raised.value.code() == code, raised.value.details()
    assert expected in raised.value.details()


def test_a_message_over_max_request_bytes_is_refused(stub):
    rows = np.zeros((MAX_REQUEST_BYTES // 16 + 1, 4), np.float32)  # 16 bytes a row: just over the limit

    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(predict_request("exact", rows), timeout=30)

    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, raised.value.details()


def test_a_full_queue_is_resource_exhausted_at_once_and_the_server_caps_the_deadline(served, stub, exact_model):
    wait_for(lambda: served.metric("model_server_queue_rows", model="held") == 0, what="an empty queue")
    # Four rows fill the held model's queue and wait in its 6 s batch window.
    first = stub.Predict.future(predict_request("held", integer_rows(HELD_QUEUE_ROWS)), timeout=60)
    wait_for(lambda: served.metric("model_server_queue_rows", model="held") == HELD_QUEUE_ROWS,
             what="the first request queued")

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        stub.Predict(predict_request("held", integer_rows(1)), timeout=60)
    refused_s = time.monotonic() - started

    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
    assert "MAX_QUEUE_ROWS" in refused.value.details()
    assert refused_s < HELD_WINDOW_MS / 1000  # answered, not queued behind the window
    # The client allowed 60 s; the server's REQUEST_TIMEOUT_MS (4 s) ends the request before its window.
    with pytest.raises(grpc.RpcError) as expired:
        first.result()
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no result from model 'held' within 4000 ms" in expired.value.details()


# -- metadata, status, metrics, logs ------------------------------------------------------------


def test_get_model_metadata_gives_the_signature(stub):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "exact"

    response = stub.GetModelMetadata(request, timeout=30)

    signatures = get_model_metadata_pb2.SignatureDefMap()
    assert response.metadata["signature_def"].Unpack(signatures)
    signature = signatures.signature_def["serving_default"]
    assert signature.method_name == "tensorflow/serving/predict"
    features = signature.inputs["features"]
    assert (features.name, features.dtype, [dim.size for dim in features.tensor_shape.dim]) == (
        "serving_default_features:0", 1, [-1, 4])
    assert [dim.size for dim in signature.outputs["scores"].tensor_shape.dim] == [-1, 3]
    assert (response.model_spec.name, response.model_spec.version.value) == ("exact", 1)


@pytest.mark.parametrize("fields, expected", [
    ([], "GetModelMetadataRequest must specify at least one metadata_field"),
    (["signature_def", "warmup"], "Metadata field warmup is not supported"),
])
def test_get_model_metadata_refuses_fields_as_tensorflow_serving_does(stub, fields, expected):
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=fields)
    request.model_spec.name = "exact"

    with pytest.raises(grpc.RpcError) as raised:
        stub.GetModelMetadata(request, timeout=30)

    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, expected)


def test_get_model_status(channel):
    models = model_service_pb2_grpc.ModelServiceStub(channel)
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "exact"

    response = models.GetModelStatus(request, timeout=30)

    (status,) = response.model_version_status
    assert (status.version, status.state, status.status.error_code) == (
        1, get_model_status_pb2.ModelVersionStatus.AVAILABLE, 0)
    request.model_spec.name = "nope"
    with pytest.raises(grpc.RpcError) as raised:
        models.GetModelStatus(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("service, expected", [
    ("", health_pb2.HealthCheckResponse.SERVING),
    ("tensorflow.serving.PredictionService", health_pb2.HealthCheckResponse.SERVING),
])
def test_health_answers_serving_when_ready(channel, service, expected):
    health = health_pb2_grpc.HealthStub(channel)

    assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status == expected


def test_health_does_not_know_other_services(channel):
    with pytest.raises(grpc.RpcError) as raised:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="other"), timeout=30)

    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_calls_are_counted_and_logged_like_http_requests(served, stub):
    ok_before = served.metric("model_server_requests_total", route=PREDICT, method="GRPC", status="OK")
    seconds_before = served.metric("model_server_request_duration_seconds_count", route=PREDICT)
    request_id = f"counted-{uuid.uuid4().hex}"

    for index in range(3):
        _, call = stub.Predict.with_call(predict_request("exact", integer_rows(2)), timeout=30,
                                         metadata=[("x-request-id", f"{request_id}-{index}")])
        # Echoed with the answer (app/ops/patches.py, initial_metadata_with_the_answer), and with a refusal.
        assert dict(call.initial_metadata())["x-request-id"] == f"{request_id}-{index}"
    with pytest.raises(grpc.RpcError) as refused:
        stub.Predict(predict_request("nope", integer_rows(1)), timeout=30, metadata=[("x-request-id", request_id)])
    assert dict(refused.value.initial_metadata())["x-request-id"] == request_id

    assert served.metric("model_server_requests_total", route=PREDICT, method="GRPC", status="OK") == ok_before + 3
    assert served.metric("model_server_request_duration_seconds_count", route=PREDICT) >= seconds_before + 4
    assert served.metric("model_server_requests_total", route=PREDICT, method="GRPC", status="NOT_FOUND") >= 1
    ok_line = access_line(served, f"{request_id}-0")
    assert {key: ok_line[key] for key in ("method", "path", "status", "rows", "batch_rows", "model")} == {
        "method": "GRPC", "path": PREDICT, "status": "OK", "rows": 2, "batch_rows": ok_line["batch_rows"],
        "model": "exact"}
    assert ok_line["batch_rows"] >= 2 and ok_line["batch_requests"] >= 1
    assert access_line(served, request_id)["status"] == "NOT_FOUND"


def test_multi_inference_runs_classify_and_regress_over_one_input(stub):
    """tensorflow_model_server_test.py's testMultiInference, on this TF1 model; the TF2 form and
    the refusals are in test_tfs_inference.py."""
    from tensorflow_serving.apis import inference_pb2

    request = inference_pb2.MultiInferenceRequest(input=examples_input([[1, 2], [-4, 1]]))
    for signature, method in (("regress", "tensorflow/serving/regress"), ("classify", "tensorflow/serving/classify")):
        task = request.tasks.add(method_name=method)
        task.model_spec.name, task.model_spec.signature_name = "examples", signature

    response = stub.MultiInference(request, timeout=30)

    assert [entry.value for entry in response.results[0].regression_result.regressions] == [4.0, -7.0]
    assert [[(entry.label, entry.score) for entry in row.classes]
            for row in response.results[1].classification_result.classifications] == [
        [("neg", -3.0), ("pos", 3.0)], [("neg", 3.0), ("pos", -3.0)]]
    assert [(result.model_spec.name, result.model_spec.signature_name, result.model_spec.version.value)
            for result in response.results] == [("examples", "regress", 1), ("examples", "classify", 1)]


# -- TensorProto <-> numpy, against TensorFlow's own decoding -----------------------------------

# Every dtype the REST path takes: (DataType name, numpy dtype, sample rows of shape [2, 3]).
DTYPES = [
    ("DT_FLOAT", np.float32, [[1.5, -2.25, 3e30], [0.0, -0.0, 7.0]]),
    ("DT_DOUBLE", np.float64, [[1.5, -2.25, 3e300], [0.0, 1e-300, 7.0]]),
    ("DT_HALF", np.float16, [[1.5, -2.25, 65504.0], [0.0, 6e-5, 7.0]]),
    ("DT_BFLOAT16", "bfloat16", [[1.5, -2.25, 3e38], [0.0, 1.0, 7.0]]),
    ("DT_INT8", np.int8, [[-128, 0, 127], [1, 2, 3]]),
    ("DT_INT16", np.int16, [[-32768, 0, 32767], [1, 2, 3]]),
    ("DT_INT32", np.int32, [[-2**31, 0, 2**31 - 1], [1, 2, 3]]),
    ("DT_INT64", np.int64, [[-2**63, 0, 2**63 - 1], [1, 2, 3]]),
    ("DT_UINT8", np.uint8, [[0, 128, 255], [1, 2, 3]]),
    ("DT_UINT16", np.uint16, [[0, 32768, 65535], [1, 2, 3]]),
    ("DT_UINT32", np.uint32, [[0, 2**31, 2**32 - 1], [1, 2, 3]]),
    ("DT_UINT64", np.uint64, [[0, 2**63, 2**64 - 1], [1, 2, 3]]),
    ("DT_BOOL", np.bool_, [[True, False, True], [False, False, True]]),
    ("DT_STRING", object, [[b"a", "é".encode(), b""], [b"\x00\xff", b"longer value", b"z"]]),
]


LIMITS = {"max_rows": 64, "max_bytes": 1 << 20}


def _sample(dtype, values) -> np.ndarray:
    if dtype == "bfloat16":
        import ml_dtypes

        return np.asarray(values, dtype=np.float32).astype(ml_dtypes.bfloat16)
    return np.asarray(values, dtype=dtype)


def _spec(name: str, array: np.ndarray):
    from app.core.models import TensorInfo

    return TensorInfo(name="x", shape=(None,), dtype=array.dtype, tf_dtype=name)


def _typed_field_proto(name: str, array: np.ndarray):
    """The same tensor in its dtype's *_val field, as a client writing protos by hand sends it."""
    from tensorflow.core.framework import tensor_pb2, types_pb2

    proto = tensor_pb2.TensorProto(dtype=types_pb2.DataType.Value(name))
    for size in array.shape:
        proto.tensor_shape.dim.add().size = size
    flat = array.flatten()
    if name in ("DT_HALF", "DT_BFLOAT16"):
        proto.half_val.extend(flat.view(np.uint16).astype(int).tolist())
    else:
        field = {"DT_FLOAT": "float_val", "DT_DOUBLE": "double_val", "DT_INT64": "int64_val",
                 "DT_UINT32": "uint32_val", "DT_UINT64": "uint64_val", "DT_BOOL": "bool_val",
                 "DT_STRING": "string_val"}.get(name, "int_val")
        getattr(proto, field).extend(flat.tolist())
    return proto


@pytest.mark.parametrize("name, dtype, values", DTYPES, ids=[entry[0] for entry in DTYPES])
def test_tensor_proto_decodes_every_form_as_tensorflow_does(name, dtype, values):
    from app.wire import tensor_proto

    array = _sample(dtype, values)
    spec = _spec(name, array)
    for proto in (make_tensor_proto(array), _typed_field_proto(name, array)):
        decoded = tensor_proto.to_ndarray(proto, spec, "inputs['x']", **LIMITS)
        reference = make_ndarray(proto)  # TensorFlow's own reading of the same proto
        assert decoded.dtype == reference.dtype == array.dtype
        np.testing.assert_array_equal(decoded, reference)
        np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("name, dtype, values", DTYPES, ids=[entry[0] for entry in DTYPES])
def test_tensor_proto_encodes_as_tensorflow_serving_answers(name, dtype, values):
    from tensorflow.core.framework import tensor_pb2

    from app.wire import tensor_proto

    array = _sample(dtype, values)
    proto = tensor_pb2.TensorProto()

    tensor_proto.from_ndarray(array, name, proto)

    np.testing.assert_array_equal(make_ndarray(proto), array)
    assert make_ndarray(proto).dtype == array.dtype
    # Every value in its dtype's typed field (predict_util.cc, kAsProtoField), as a hand-written proto has them.
    assert proto == _typed_field_proto(name, array)
    assert not proto.tensor_content
    if name != "DT_STRING":  # --enable_serialization_as_tensor_content: raw bytes, and no typed field
        raw = tensor_pb2.TensorProto()
        tensor_proto.from_ndarray(array, name, raw, tensor_content=True)
        np.testing.assert_array_equal(make_ndarray(raw), array)
        assert raw.tensor_content == np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
        assert raw.ListFields()[-1][0].name == "tensor_content"  # the last field set: no *_val after it


@pytest.mark.parametrize("name, array", [
    # 20,000 bytes: a length of three varint bytes; transposed: not contiguous.
    ("DT_FLOAT", np.arange(5000, dtype=np.float32).reshape(50, 100).T / 7),
    ("DT_DOUBLE", np.linspace(-1e300, 1e300, 300).reshape(3, 100)),
    ("DT_FLOAT", np.zeros((0, 3), np.float32)),
], ids=["float-5000-transposed", "double-300", "float-empty"])
def test_float_answers_are_the_bytes_the_typed_field_itself_writes(name, array):
    from tensorflow.core.framework import tensor_pb2

    from app.wire import tensor_proto

    proto = tensor_pb2.TensorProto()

    tensor_proto.from_ndarray(array, name, proto)

    # Written whole as the field's packed bytes: the same message, and the same wire bytes.
    expected = _typed_field_proto(name, array)
    assert proto == expected
    assert proto.SerializeToString() == expected.SerializeToString()
    np.testing.assert_array_equal(make_ndarray(proto), array)


def test_a_short_typed_field_is_filled_with_its_last_value_as_tensorflow_does():
    from app.wire import tensor_proto

    proto = _typed_field_proto("DT_INT32", np.array([[1, 2, 3, 4]], np.int32))
    proto.tensor_shape.dim[0].size = 2  # eight values wanted, four given
    spec = _spec("DT_INT32", np.zeros(1, np.int32))

    decoded = tensor_proto.to_ndarray(proto, spec, "x", **LIMITS)

    np.testing.assert_array_equal(decoded, make_ndarray(proto))
    np.testing.assert_array_equal(decoded, [[1, 2, 3, 4], [4, 4, 4, 4]])


@pytest.mark.parametrize("name, values, expected", [
    ("DT_INT8", [200], "outside the range of DT_INT8"),
    ("DT_UINT8", [-1], "outside the range of DT_UINT8"),
    ("DT_HALF", [70000], "not a 16-bit pattern"),
])
def test_typed_values_outside_the_dtype_are_invalid(name, values, expected):
    from tensorflow.core.framework import tensor_pb2, types_pb2

    from app.core.errors import InvalidInput
    from app.wire import tensor_proto

    proto = tensor_pb2.TensorProto(dtype=types_pb2.DataType.Value(name))
    for size in (1, 1):
        proto.tensor_shape.dim.add().size = size
    (proto.half_val if name == "DT_HALF" else proto.int_val).extend(values)
    spec = _spec(name, np.zeros(1, np.float16 if name == "DT_HALF" else np.int8))

    with pytest.raises(InvalidInput, match=expected):
        tensor_proto.to_ndarray(proto, spec, "x", **LIMITS)


def test_a_tensor_too_large_once_decoded_is_refused_before_it_is_allocated():
    from tensorflow.core.framework import tensor_pb2

    from app.core.errors import PayloadTooLarge
    from app.core.models import TensorInfo
    from app.wire import tensor_proto

    proto = tensor_pb2.TensorProto(dtype=1, float_val=[1.0])
    for size in (1, 10**9):
        proto.tensor_shape.dim.add().size = size
    spec = TensorInfo(name="x", shape=(None,), dtype=np.dtype(np.float32), tf_dtype="DT_FLOAT")

    with pytest.raises(PayloadTooLarge, match=r"holds 1000000000 values, more than a request may carry"):
        tensor_proto.to_ndarray(proto, spec, "x", **LIMITS)


def test_every_serving_error_has_its_status_code():
    from app.core import errors
    from app.core.errors import SignatureNotFound
    from app.grpc.calls import status_code

    expected = {
        errors.BadRequest: grpc.StatusCode.INVALID_ARGUMENT,
        errors.InvalidInput: grpc.StatusCode.INVALID_ARGUMENT,
        SignatureNotFound: grpc.StatusCode.FAILED_PRECONDITION,
        errors.NotFound: grpc.StatusCode.NOT_FOUND,
        errors.PayloadTooLarge: grpc.StatusCode.INVALID_ARGUMENT,
        errors.PredictFailed: grpc.StatusCode.INTERNAL,
        errors.QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
        errors.ShuttingDown: grpc.StatusCode.UNAVAILABLE,
        errors.BatcherBroken: grpc.StatusCode.UNAVAILABLE,
        errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
        errors.ServingError: grpc.StatusCode.INTERNAL,
    }

    assert {cls: status_code(cls("x")) for cls in expected} == expected


# -- the server in-process: readiness lost, shutting down --------------------------------------


def test_health_turns_not_serving_and_predict_unavailable_once_the_batchers_stop(in_process_app, exact_model_path):
    # In this process: the batchers of a Gunicorn worker only stop as it exits, and
    # in_process_app's can be stopped while its gRPC server still answers.
    from app.grpc import server as grpc_server
    from tests.conftest import free_port

    app = in_process_app(model_path=str(exact_model_path))
    target = f"127.0.0.1:{free_port()}"
    seen = []
    with grpc_server.serving(app.services, bind=target), grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for _ in range(2):
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=30).status
            try:
                stub.Predict(predict_request("default", integer_rows(1)), timeout=30)
                code = "OK"
            except grpc.RpcError as exc:
                code = f"{exc.code().name}: {exc.details()}"
            seen.append([health_pb2.HealthCheckResponse.ServingStatus.Name(status), code])
            app.services.registry.close(drain=True)

    assert seen == [["SERVING", "OK"], ["NOT_SERVING", "UNAVAILABLE: the server is shutting down"]]


# -- several workers, and SIGTERM ---------------------------------------------------------------


def test_every_worker_serves_grpc_on_the_one_port_and_the_master_never_imports_grpc(start_server, exact_model_path,
                                                                                    exact_model):
    server = start_server({"MODEL_PATH": str(exact_model_path), "LOG_FORMAT": "json", "MODEL_POLL_SECONDS": "0"},
                          workers=2)
    workers = set(server.wait_ready(workers=2))
    pids: dict[str, int] = {}
    # A channel is one connection, which the kernel gives one worker (SO_REUSEPORT): fresh
    # channels until both have answered (40 misses in a row would be one chance in 2**39).
    for attempt in range(40):
        rows = integer_rows(2, seed=attempt)
        request_id = f"worker-{uuid.uuid4().hex}"
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
            response = stub.Predict(predict_request("default", rows), timeout=30,
                                    metadata=[("x-request-id", request_id)])
        np.testing.assert_array_equal(scores(response), exact_model(rows).numpy())
        pids[request_id] = access_line(server, request_id)["pid"]
        if set(pids.values()) == workers:
            break

    assert set(pids.values()) == workers
    # grpc lives in the workers only: its threads would not survive the master's forks.
    with open(f"/proc/{server.proc.pid}/maps") as maps:
        assert "cygrpc" not in maps.read()
    with open(f"/proc/{next(iter(workers))}/maps") as maps:
        assert "cygrpc" in maps.read()


def test_sigterm_under_grpc_load_answers_every_accepted_call(start_server, exact_model_path, exact_model):
    # A 3 s batch window keeps eight gRPC calls queued while SIGTERM arrives. One HTTP request
    # keeps Gunicorn's graceful drain open: its body is still being sent when the stop comes
    # (a request held in a batch window would not: a stop cuts the window, docs/stopping.md).
    # Every body counts as large, so /readyz shows when the worker is reading it.
    server = start_server({"MODEL_PATH": str(exact_model_path), "LOG_FORMAT": "json", "MODEL_POLL_SECONDS": "0",
                           "BATCH_TIMEOUT_MS": "3000", "LARGE_BODY_BYTES": "16"})
    expected = {seed: exact_model(integer_rows(1, seed=seed)).numpy() for seed in range(40)}
    outcomes: list[tuple[int, str, np.ndarray | None]] = []
    lock = threading.Lock()

    def call(stub, seed: int) -> None:
        try:
            response = stub.Predict(predict_request("default", integer_rows(1, seed=seed)), timeout=60)
            outcome = (seed, "OK", scores(response))
        except grpc.RpcError as exc:
            outcome = (seed, exc.code().name, None)
        with lock:
            outcomes.append(outcome)

    def refused() -> bool:
        with grpc.insecure_channel(server.grpc_target) as fresh:
            try:
                health_pb2_grpc.HealthStub(fresh).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAVAILABLE
        return False

    def keep_calling(stub, seeds) -> None:
        for seed in seeds:  # until the server refuses: after SIGTERM it takes no new call
            call(stub, seed)
            if outcomes[-1][1] != "OK":
                return

    http_rows = integer_rows(1, seed=99)
    body = json.dumps({"instances": http_rows.tolist()}).encode()
    late = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    with grpc.insecure_channel(server.grpc_target) as channel, contextlib.closing(late):
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        held = [threading.Thread(target=call, args=(stub, seed)) for seed in range(8)]
        for thread in held:
            thread.start()
        wait_for(lambda: server.metric("model_server_queue_rows", model="default") == 8, what="eight calls queued")
        late.putrequest("POST", "/predict")
        late.putheader("Content-Type", "application/json")
        late.putheader("Content-Length", str(len(body)))
        late.endheaders(body[:1])
        wait_for(lambda: requests.get(server.url + "/readyz", timeout=10).json()["large_bodies_in_flight"] == 1,
                 what="the worker reading the HTTP request's body")
        loaders = [threading.Thread(target=keep_calling, args=(stub, range(start, 40, 4))) for start in (8, 9)]
        for thread in loaders:
            thread.start()
        server.send(signal.SIGTERM)
        # gRPC stops taking calls when HTTP does, at SIGTERM, not once HTTP's drain is over: the
        # HTTP request is still unsent here, so that drain cannot have ended.
        wait_for(refused, within_s=30, what="gRPC refusing new calls while HTTP drains")
        late.send(body[1:])
        http_answer = late.getresponse()
        assert http_answer.status == 200
        assert json.loads(http_answer.read())["predictions"] == exact_model(http_rows).numpy().tolist()
        for thread in held + loaders:
            thread.join(120)
        assert server.proc.wait(60) == 0

    by_seed = {seed: (status, answer) for seed, status, answer in outcomes}
    assert all(by_seed[seed][0] == "OK" for seed in range(8)), by_seed
    for seed, (status, answer) in by_seed.items():
        # Refused: UNAVAILABLE once the server stopped, CANCELLED for a call grpc's core held
        # unclaimed as it shut down; neither reached the server's handler (see below).
        assert status in ("OK", "UNAVAILABLE", "CANCELLED"), (seed, status)
        if status == "OK":
            np.testing.assert_array_equal(answer, expected[seed])
    # Every call the server took (each leaves an access line) was answered to its client.
    answered = [line for line in access_lines(server) if line["path"] == PREDICT]
    assert [line["status"] for line in answered] == ["OK"] * len(answered)
    assert len(answered) == sum(status == "OK" for status, _ in by_seed.values())


# -- version labels, Classify and Regress ------------------------------------------------------


def versioned_request(stub, rows: np.ndarray, **spec) -> predict_pb2.PredictRequest:
    """A Predict request for the exported model, its input named as its metadata names it."""
    metadata = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    metadata.model_spec.name = "versioned"
    signatures = get_model_metadata_pb2.SignatureDefMap()
    stub.GetModelMetadata(metadata, timeout=30).metadata["signature_def"].Unpack(signatures)
    (name,) = signatures.signature_def["serving_default"].inputs
    request = predict_request("versioned", **spec)
    request.inputs[name].CopyFrom(make_tensor_proto(rows))
    return request


def only_output(response) -> np.ndarray:
    (output,) = response.outputs.values()
    return make_ndarray(output)


def test_a_version_label_is_served_by_its_version(stub, exact_model, second_model):
    rows = integer_rows(5, seed=21)
    for label, version, model in (("stable", 1, exact_model), ("canary", 2, second_model)):
        response = stub.Predict(versioned_request(stub, rows, version_label=label), timeout=30)

        assert response.model_spec.version.value == version, label
        np.testing.assert_array_equal(only_output(response), model(rows).numpy())
    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(versioned_request(stub, rows, version_label="beta"), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Unrecognized servable version label: beta" in raised.value.details()


def test_get_model_status_lists_every_version_or_the_one_named(channel):
    models = model_service_pb2_grpc.ModelServiceStub(channel)
    available = get_model_status_pb2.ModelVersionStatus.AVAILABLE

    def statuses(**spec) -> list[tuple[int, int]]:
        request = get_model_status_pb2.GetModelStatusRequest()
        request.model_spec.name = "versioned"
        if "version" in spec:
            request.model_spec.version.value = spec["version"]
        if "label" in spec:
            request.model_spec.version_label = spec["label"]
        return [(status.version, status.state) for status in models.GetModelStatus(request, timeout=30)
                .model_version_status]

    assert statuses() == [(2, available), (1, available)]  # newest first, as TF Serving lists them
    assert statuses(label="stable") == [(1, available)]
    assert statuses(version=2) == [(2, available)]
    with pytest.raises(grpc.RpcError) as raised:
        statuses(version=3)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def examples_input(rows: list[list[float] | None], context: list[float] | None = None):
    """tensorflow.serving.Input: tf.Examples with a float feature x (None: no x of its own)."""
    from tensorflow_serving.apis import input_pb2

    model_input = input_pb2.Input()
    target = model_input.example_list_with_context if context is not None else model_input.example_list
    if context is not None:
        target.context.features.feature["x"].float_list.value.extend(context)
    for values in rows:
        example = target.examples.add()
        if values is not None:
            example.features.feature["x"].float_list.value.extend(values)
    return model_input


def test_classify_answers_classes_and_scores_per_example(stub):
    from tensorflow_serving.apis import classification_pb2

    request = classification_pb2.ClassificationRequest(input=examples_input([[1, 2], None, [-4, 1]], context=[5, 6]))
    request.model_spec.name = "examples"
    request.model_spec.signature_name = "classify"

    response = stub.Classify(request, timeout=30)

    # scores [-(x0 + x1), x0 + x1]; the second example takes its x from the context.
    assert [[(entry.label, entry.score) for entry in row.classes] for row in response.result.classifications] == [
        [("neg", -3.0), ("pos", 3.0)], [("neg", -11.0), ("pos", 11.0)], [("neg", 3.0), ("pos", -3.0)]]
    assert (response.model_spec.name, response.model_spec.signature_name) == ("examples", "classify")


def test_regress_answers_one_value_per_example(stub):
    from tensorflow_serving.apis import regression_pb2

    request = regression_pb2.RegressionRequest(input=examples_input([[1, 2], [3, -1], [0.5, 0]]))
    request.model_spec.name = "examples"
    request.model_spec.signature_name = "regress"

    response = stub.Regress(request, timeout=30)

    assert [entry.value for entry in response.result.regressions] == [4.0, 5.0, 1.0]  # 2 x0 + x1
    assert response.model_spec.version.value == 1


@pytest.mark.parametrize("method, signature, examples, expected", [
    ("Regress", "classify", [[1, 2]], "Expected one output Tensor."),
    ("Classify", "nope", [[1, 2]], "No signature was found with the name: nope"),
    ("Classify", "classify", [], "Input is empty."),
    ("Regress", "regress", [[1, 2]] * (EXACT_ROW_LIMIT + 1), "MAX_REQUEST_ROWS"),
])
def test_classify_and_regress_refuse_as_tensorflow_serving_does(stub, method, signature, examples, expected):
    from tensorflow_serving.apis import classification_pb2, regression_pb2

    message = classification_pb2.ClassificationRequest if method == "Classify" else regression_pb2.RegressionRequest
    request = message(input=examples_input(examples))
    request.model_spec.name = "examples"
    request.model_spec.signature_name = signature

    with pytest.raises(grpc.RpcError) as raised:
        getattr(stub, method)(request, timeout=30)

    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in raised.value.details()


# Last, so that the rows the full-queue test left in the held model's 6 s window are gone by
# now, not waited out; nothing after it uses that model, whose window its own row waits in.
def test_the_clients_deadline_becomes_the_requests(served, stub):
    wait_for(lambda: served.metric("model_server_queue_rows", model="held") == 0, within_s=HELD_WINDOW_MS / 500,
             what="an empty queue")
    request_id = f"deadline-{uuid.uuid4().hex}"

    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(predict_request("held", integer_rows(1)), timeout=0.5, metadata=[("x-request-id", request_id)])

    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The server itself gave up at the client's deadline: without it the request would have
    # waited out the 6 s window (and REQUEST_TIMEOUT_MS) and been answered OK, to nobody.
    line = access_line(served, request_id)
    assert line["status"] == "DEADLINE_EXCEEDED"
    assert line["latency_ms"] < REQUEST_TIMEOUT_MS
