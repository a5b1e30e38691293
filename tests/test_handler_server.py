"""Handlers (app/core/handlers.py, docs/handlers.md) on a live server: the two examples on every
door, their errors, and the combinations of issue 56 that a server shows.

One server (a module fixture; the --model-processes pass runs it again with MODEL_PROCESSES=1)
serves, from one MODEL_CONFIG:

    image    examples/image_classifier: JPEG or PNG bytes in, the top 5 labels and scores out
             (its handler named by module); the default model, so /predict reaches it too
    text     examples/text_classifier: a custom Keras layer, a tokenizer, a batch key on the v2
             parameter `temperature` (its handler named by a .py path); padded to the batch's
             longest, two priority levels, batches of 4 rows
    faults   the text model behind tests/handler_faults.py: errors on request
    warm     the text model as a SavedModel whose warm-up record is what a client sends (bytes)

and a repository (MODEL_CONTROL_MODE=explicit, MODEL_REPOSITORY_HANDLERS=true) of the same
SavedModel with a handler.py beside it. It is traced to an OTLP receiver here, and every
prediction of `image` is payload-logged. Each answer is compared with the model's own output on
the handler's own decoding of the same bytes, row for row.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import re
import shutil
import struct
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from tritonclient.grpc import service_pb2, service_pb2_grpc

from examples.image_classifier import handler as image_handler
from examples.image_classifier import photos
from examples.text_classifier import handler as text_handler
from tests.conftest import REPO, Server, wait_for
from tests.test_payload_log import read_records
from tests.test_tracing import OtlpReceiver

TIMEOUT_S = 60
TEXT_BATCH = 4
# The image model's scores: one CNN on one CPU, whatever the batch (checked as equal where they are).
RTOL, ATOL = 1e-6, 1e-7


def png(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.open(io.BytesIO(photos.photo(seed))).resize((320, 240)).save(out, "PNG")
    return out.getvalue()


PHOTOS = [photos.photo(0), png(1), photos.photo(2)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The example models, saved, and loaded back here (the text model through its custom objects)."""
    import keras

    from examples.image_classifier import model as image_model
    from examples.text_classifier import model as text_model

    root = tmp_path_factory.mktemp("handled-models")
    image_model.build().save(root / "image.keras")
    text = text_model.build()
    text.save(root / "text.keras")
    export(text, root / "warm" / "1")
    write_warmup(root / "warm" / "1", [b"warm bread", b"cold milk"])
    shutil.copytree(root / "warm", root / "repository" / "repo_text")
    (root / "repository" / "repo_text" / "handler.py").write_text(
        "from examples.text_classifier.handler import batch_key, custom_objects, postprocess, preprocess, signature"
        "  # noqa: F401\n")
    loaded = {"image": keras.models.load_model(root / "image.keras", compile=False),
              "text": keras.models.load_model(root / "text.keras", compile=False,
                                              custom_objects=text_handler.custom_objects())}
    return root, loaded


def export(model, folder: Path) -> None:
    """The text model as a SavedModel whose serving_default names its output as the .keras file does."""
    import keras
    import tensorflow as tf

    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serving_default", lambda inputs: {"probabilities": model(inputs)}, input_signature=[{
        "tokens": tf.TensorSpec((None, None), tf.int32, name="tokens"),
        "temperature": tf.TensorSpec((None, 1), tf.float32, name="temperature")}])
    archive.write_out(str(folder), verbose=False)


def write_warmup(folder: Path, texts: list[bytes]) -> None:
    """A warm-up record of what a client sends the handled model: its texts, as bytes."""
    import tensorflow as tf
    from tensorflow_serving.apis import prediction_log_pb2

    record = prediction_log_pb2.PredictionLog()
    record.predict_log.request.inputs["text"].CopyFrom(tf.make_tensor_proto(np.array(texts, dtype=object)))
    (folder / "assets.extra").mkdir(parents=True)
    with tf.io.TFRecordWriter(str(folder / "assets.extra" / "tf_serving_warmup_requests")) as writer:
        writer.write(record.SerializeToString())


@pytest.fixture(scope="module")
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, models, receiver):
    root, _ = models
    text = {"path": str(root / "text.keras"), "max_batch_size": TEXT_BATCH, "batch_timeout_ms": 400}
    config = {"default": "image", "models": [
        {"name": "image", "path": str(root / "image.keras"), "handler": "examples.image_classifier.handler",
         "payload_log_sampling_rate": 1},
        {"name": "text", **text, "handler": str(REPO / "examples" / "text_classifier" / "handler.py"),
         "pad_variable_length": True, "priority_levels": 2, "default_priority_level": 2},
        {"name": "faults", **text, "handler": "tests.handler_faults"},
        {"name": "warm", "path": str(root / "warm"), "handler": "examples.text_classifier.handler"},
    ]}
    (root / "models.json").write_text(json.dumps(config))
    running = Server(tmp_path_factory.mktemp("handled-logs"), {
        "MODEL_CONFIG": str(root / "models.json"), "MODEL_REPOSITORY": str(root / "repository"),
        "MODEL_CONTROL_MODE": "explicit", "MODEL_REPOSITORY_HANDLERS": "true", "MODEL_POLL_SECONDS": "0",
        "PAYLOAD_LOG_DIR": str(root / "payload"), "TRACING": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"})
    running.start()
    yield running
    running.stop()


# -- what the models answer by themselves --------------------------------------------------------


def own_image(models, data: list[bytes]) -> dict[str, np.ndarray]:
    """The image model's own answer on the handler's own decoding of `data`."""
    pixels = np.stack([image_handler.decode(item) for item in data])
    probabilities = np.asarray(models[1]["image"](pixels))
    return image_handler.postprocess({"probabilities": probabilities}, {}, {})


def own_text(models, texts: list[bytes], temperature: float = 1.0) -> dict[str, np.ndarray]:
    """The text model's own answer on the handler's own tokens of `texts`, alone at `temperature`."""
    parameters = {"temperature": temperature}
    inputs = text_handler.preprocess({"text": np.array(texts, dtype=object)}, parameters)
    probabilities = np.asarray(models[1]["text"](inputs))
    return text_handler.postprocess({"probabilities": probabilities}, {}, parameters)


def assert_image(answer: dict[str, np.ndarray], own: dict[str, np.ndarray]) -> None:
    assert [list(row) for row in answer["labels"]] == [[label.decode() for label in row] for row in own["labels"]]
    np.testing.assert_allclose(np.asarray(answer["scores"], np.float32), own["scores"], rtol=RTOL, atol=ATOL)


def assert_text(answer: dict[str, np.ndarray], own: dict[str, np.ndarray]) -> None:
    assert list(answer["label"]) == [label.decode() for label in own["label"]]
    np.testing.assert_allclose(np.asarray(answer["probabilities"], np.float32), own["probabilities"],
                               rtol=1e-5, atol=1e-6)


# -- the doors ---------------------------------------------------------------------------------


def tfs_rest(server, model: str, name: str, values: list[bytes], *, path: str | None = None,
             headers: dict | None = None) -> requests.Response:
    """TF Serving's row format, each value as {"b64": ...}."""
    instances = [{"b64": base64.b64encode(value).decode()} for value in values]
    return requests.post(server.url + (path or f"/v1/models/{model}:predict"), json={"instances": instances},
                         headers=headers, timeout=TIMEOUT_S)


def rows_of(answer: requests.Response) -> dict[str, np.ndarray]:
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    return {name: np.array([row[name] for row in predictions]) for name in predictions[0]}


def v2_json(server, model: str, name: str, values: list[bytes], parameters: dict | None = None,
            headers: dict | None = None) -> requests.Response:
    body = {"inputs": [{"name": name, "datatype": "BYTES", "shape": [len(values)],
                        "data": [value.decode() for value in values]}], "parameters": parameters or {}}
    return requests.post(f"{server.url}/v2/models/{model}/infer", json=body, headers=headers, timeout=TIMEOUT_S)


def v2_binary(server, model: str, name: str, values: list[bytes], parameters: dict | None = None
              ) -> requests.Response:
    """v2 with Triton's binary tensor data: BYTES elements length-prefixed after the JSON header."""
    raw = b"".join(struct.pack("<I", len(value)) + value for value in values)
    header = json.dumps({"inputs": [{"name": name, "datatype": "BYTES", "shape": [len(values)],
                                     "parameters": {"binary_data_size": len(raw)}}],
                         "parameters": parameters or {}}).encode()
    return requests.post(f"{server.url}/v2/models/{model}/infer", data=header + raw, timeout=TIMEOUT_S,
                         headers={"Inference-Header-Content-Length": str(len(header))})


def v2_outputs(answer: requests.Response) -> dict[str, np.ndarray]:
    assert answer.status_code == 200, answer.text
    return {output["name"]: np.array(output["data"]).reshape(output["shape"]) for output in answer.json()["outputs"]}


def tfs_grpc(server, model: str, name: str, values: list[bytes]) -> dict[str, np.ndarray]:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    request.inputs[name].CopyFrom(tf.make_tensor_proto(np.array(values, dtype=object)))
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=TIMEOUT_S)
    return {key: _texts(tf.make_ndarray(tensor)) for key, tensor in reply.outputs.items()}


def _texts(array: np.ndarray) -> np.ndarray:
    return np.vectorize(bytes.decode, otypes=[object])(array) if array.dtype == object else array


def v2_grpc(server, model: str, name: str, values: list[bytes], parameters: dict | None = None,
            timeout_s: float = TIMEOUT_S) -> dict[str, np.ndarray]:
    request = service_pb2.ModelInferRequest(model_name=model)
    request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(value)) + value for value in values))
    for key, value in (parameters or {}).items():
        field = {float: "double_param", int: "int64_param", str: "string_param"}[type(value)]
        setattr(request.parameters[key], field, value)
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=timeout_s)
    return {output.name: _v2_raw(output, raw) for output, raw in zip(reply.outputs, reply.raw_output_contents,
                                                                      strict=True)}


def _v2_raw(output, raw: bytes) -> np.ndarray:
    if output.datatype != "BYTES":
        return np.frombuffer(raw, dtype="<f4").reshape(tuple(output.shape))
    values, offset = [], 0
    while offset < len(raw):
        (length,) = struct.unpack_from("<I", raw, offset)
        values.append(raw[offset + 4:offset + 4 + length].decode())
        offset += 4 + length
    return np.array(values, dtype=object).reshape(tuple(output.shape))


IMAGE_DOORS = {
    "tfs-rest": lambda server: rows_of(tfs_rest(server, "image", "image_bytes", PHOTOS)),
    "predict": lambda server: rows_of(tfs_rest(server, "", "image_bytes", PHOTOS, path="/predict")),
    "tfs-grpc": lambda server: tfs_grpc(server, "image", "image_bytes", PHOTOS),
    "v2-binary": lambda server: v2_outputs(v2_binary(server, "image", "image_bytes", PHOTOS)),
    "v2-grpc": lambda server: v2_grpc(server, "image", "image_bytes", PHOTOS),
}


@pytest.mark.parametrize("door", sorted(IMAGE_DOORS))
def test_the_image_example_answers_each_door_as_its_model_does(server, models, door):
    assert_image(IMAGE_DOORS[door](server), own_image(models, PHOTOS))


TEXTS = [b"Fresh milk and cheese", b"a loaf of rye bread", b"ripe bananas"]
TEXT_DOORS = {
    "tfs-rest": lambda server, _t: rows_of(tfs_rest(server, "text", "text", TEXTS)),
    "tfs-grpc": lambda server, _t: tfs_grpc(server, "text", "text", TEXTS),
    "v2-json": lambda server, t: v2_outputs(v2_json(server, "text", "text", TEXTS, {"temperature": t})),
    "v2-binary": lambda server, t: v2_outputs(v2_binary(server, "text", "text", TEXTS, {"temperature": t})),
    "v2-grpc": lambda server, t: v2_grpc(server, "text", "text", TEXTS, {"temperature": t}),
}


@pytest.mark.parametrize("door", sorted(TEXT_DOORS))
def test_the_text_example_answers_each_door_as_its_model_does_with_v2_parameters(server, models, door):
    # TF Serving's doors carry no parameters: the handler's default temperature, 1.0.
    temperature = 1.0 if door.startswith("tfs") else 0.25
    assert_text(TEXT_DOORS[door](server, temperature), own_text(models, TEXTS, temperature))


def test_metadata_on_every_door_shows_the_handlers_signature(server):
    from tensorflow_serving.apis import get_model_metadata_pb2, prediction_service_pb2_grpc

    rest = requests.get(f"{server.url}/v1/models/image/metadata", timeout=TIMEOUT_S).json()
    shown = rest["metadata"]["signature_def"]["signature_def"]
    assert list(shown) == ["serving_default"]
    assert {name: (tensor["dtype"], [dim["size"] for dim in tensor["tensor_shape"]["dim"]])
            for name, tensor in shown["serving_default"]["inputs"].items()} == {"image_bytes": ("DT_STRING", ["-1"])}
    assert {name: (tensor["dtype"], [dim["size"] for dim in tensor["tensor_shape"]["dim"]])
            for name, tensor in shown["serving_default"]["outputs"].items()} == {
        "labels": ("DT_STRING", ["-1", "5"]), "scores": ("DT_FLOAT", ["-1", "5"])}
    request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
    request.model_spec.name = "image"
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(request, timeout=TIMEOUT_S)
        v2_reply = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelMetadata(
            service_pb2.ModelMetadataRequest(name="image"), timeout=TIMEOUT_S)
    signatures = get_model_metadata_pb2.SignatureDefMap()
    reply.metadata["signature_def"].Unpack(signatures)
    assert sorted(signatures.signature_def["serving_default"].inputs) == ["image_bytes"]
    assert sorted(signatures.signature_def["serving_default"].outputs) == ["labels", "scores"]
    v2 = requests.get(f"{server.url}/v2/models/image", timeout=TIMEOUT_S).json()
    tensors = [(t["name"], t["datatype"], t["shape"]) for t in [*v2["inputs"], *v2["outputs"]]]
    assert tensors == [("image_bytes", "BYTES", [-1]), ("labels", "BYTES", [-1, 5]), ("scores", "FP32", [-1, 5])]
    assert [(t.name, t.datatype, list(t.shape)) for t in [*v2_reply.inputs, *v2_reply.outputs]] == tensors
    openapi = requests.get(f"{server.url}/openapi.json", timeout=TIMEOUT_S).json()
    assert openapi["x-model-signatures"]["image"] == {
        "inputs": {"image_bytes": {"dtype": "bytes", "shape": []}},
        "outputs": {"labels": {"dtype": "bytes", "shape": [5]}, "scores": {"dtype": "float32", "shape": [5]}}}


def concurrently(*sends):
    with concurrent.futures.ThreadPoolExecutor(len(sends)) as pool:
        return [future.result() for future in [pool.submit(send) for send in sends]]


def test_rows_of_another_batch_key_never_share_a_call(server, models):
    # Four requests of one row at each temperature, sent at once, interleaved; batches of four rows:
    # without the key, the first four rows to arrive would share a call, and the Scale layer would
    # answer all of them at the first row's temperature.
    cases = [([TEXTS[index % 3]], temperature) for index in range(4) for temperature in (0.5, 4.0)]
    answers = concurrently(*(lambda texts=texts, t=temperature: v2_json(server, "text", "text", texts,
                                                                          {"temperature": t})
                             for texts, temperature in cases))
    for answer, (texts, temperature) in zip(answers, cases, strict=True):
        assert_text(v2_outputs(answer), own_text(models, texts, temperature))
        assert answer.headers["X-Batch-Requests"] == "4", "one key: its four requests fill a call"


def test_rows_of_other_lengths_are_padded_into_one_call_and_priorities_are_taken(server, models):
    short, long = [b"milk", b"bread"], [b"apples and ripe bananas", b"a loaf of fresh rye bread today"]
    answers = concurrently(lambda: v2_json(server, "text", "text", short, {"priority": 1}),
                           lambda: tfs_rest(server, "text", "text", long, headers={"X-Priority": "1"}))
    assert_text(v2_outputs(answers[0]), own_text(models, short))
    assert_text(rows_of(answers[1]), own_text(models, long))
    assert [answer.headers["X-Batch-Requests"] for answer in answers] == ["2", "2"]


def test_warm_up_replays_what_clients_send_through_the_handler(server, models):
    assert re.search(r"model 'warm' v1: 1 warm-up requests replayed", server.log())
    assert_text(v2_outputs(v2_json(server, "warm", "text", TEXTS)), own_text(models, TEXTS))


def test_a_repository_load_imports_the_folders_handler_when_the_setting_says_so(server, models):
    load = requests.post(f"{server.url}/v2/repository/models/repo_text/load", json={}, timeout=TIMEOUT_S)
    assert load.status_code == 200, load.text
    try:
        assert_text(v2_outputs(v2_json(server, "repo_text", "text", TEXTS, {"temperature": 2.0})),
                    own_text(models, TEXTS, 2.0))
        # The reload kept the handlers the operator gave the models it did not change.
        assert_text(v2_outputs(v2_json(server, "text", "text", TEXTS)), own_text(models, TEXTS))
    finally:
        unload = requests.post(f"{server.url}/v2/repository/models/repo_text/unload", json={}, timeout=TIMEOUT_S)
        assert unload.status_code == 200, unload.text


# -- errors ----------------------------------------------------------------------------------------


def test_a_handlers_value_error_is_the_clients_400_on_every_door(server):
    answer = v2_json(server, "faults", "text", [b"bad"])
    assert (answer.status_code, answer.json()) == (400, {"error": "preprocess: the text 'bad' is refused"})
    answer = tfs_rest(server, "image", "image_bytes", [b"not a photo"])
    assert (answer.status_code, answer.json()) == (400, {"error": "preprocess: image_bytes is not a JPEG or PNG image"})
    with pytest.raises(grpc.RpcError) as refused:
        v2_grpc(server, "text", "text", [b"fine"], {"temperature": "hot"})
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "batch_key: parameter 'temperature' must be a number from 0.05 to 20; " \
                                      "got 'hot'"


def test_a_handlers_crash_fails_its_request_alone_with_its_request_id_and_one_traceback(server, models):
    # Four requests of one row, two words each, one temperature: one call of four rows.
    good = [[b"fresh milk"], [b"rye bread"], [b"ripe lemons"]]
    answers = concurrently(lambda: v2_json(server, "faults", "text", [b"crash after"],
                                           headers={"X-Request-ID": "crash-after-1"}),
                           *(lambda texts=texts: v2_json(server, "faults", "text", texts) for texts in good))
    failed, *answered = answers
    assert failed.status_code == 500
    assert failed.json()["error"] == ("handler postprocess raised RuntimeError: postprocess failed on purpose "
                                      "(request id crash-after-1)")
    assert failed.headers["X-Request-ID"] == "crash-after-1"
    for answer, texts in zip(answered, good, strict=True):
        assert_text(v2_outputs(answer), own_text(models, texts))
    # The four shared one call of four rows: the failure came after it, for its own request alone.
    assert {answer.headers["X-Batch-Requests"] for answer in answered} == {"4"}
    log = wait_for(lambda: server.log() if "request_id=crash-after-1" in server.log() else None, what="the log")
    assert log.count("RuntimeError: postprocess failed on purpose") == 1
    assert re.search(r"handler tests\.handler_faults: postprocess raised, model faults, request_id=crash-after-1\n"
                     r"Traceback", log)


@pytest.mark.parametrize("text, message", [
    (b"crash", "handler preprocess raised KeyError: 'no such key' (request id {})"),
    (b"wrong shape", "handler postprocess returned 'label' of shape [0]; expected 1 rows of [] (request id {})"),
])
def test_a_handlers_other_faults_are_500s_naming_the_request(server, text, message):
    answer = v2_json(server, "faults", "text", [text])
    assert answer.status_code == 500
    assert answer.json() == {"error": message.format(answer.headers["X-Request-ID"])}
    with pytest.raises(grpc.RpcError) as failed:
        v2_grpc(server, "faults", "text", [text])
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert failed.value.details().startswith(message.split(" (request id")[0])


def test_a_slow_handler_is_held_to_the_calls_deadline(server):
    # v2's `timeout` (microseconds) sets the server's deadline. Over HTTP the request's thread runs
    # the handler to its end, then answers 504; over gRPC the call ends at its deadline.
    started = time.monotonic()
    answer = v2_json(server, "faults", "text", [b"slow 2"], {"timeout": 300_000})
    assert (answer.status_code, answer.json()) == (
        504, {"error": "the call's deadline passed while its handler's preprocess ran"})
    assert time.monotonic() - started >= 2
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        v2_grpc(server, "faults", "text", [b"slow 2"], {"timeout": 300_000})
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert late.value.details() == "the call's deadline passed while its handler ran"
    assert time.monotonic() - started < 1.5


def test_classify_is_refused_for_a_model_with_a_handler(server):
    answer = requests.post(f"{server.url}/v1/models/text:classify", json={"examples": [{"text": "milk"}]},
                           timeout=TIMEOUT_S)
    assert answer.status_code == 400
    assert answer.json() == {"error": "model 'text' has a handler, which answers Predict only"}


def test_a_request_cannot_name_a_handler(server, models):
    # A parameter of that name is the handler's to read, not the server's: the model's own handler runs.
    answer = v2_json(server, "text", "text", TEXTS, {"handler": "tests.handler_faults", "temperature": 0.5})
    assert_text(v2_outputs(answer), own_text(models, TEXTS, 0.5))


# -- tracing and payload logging -----------------------------------------------------------------


def test_a_traced_request_has_a_span_for_preprocess_and_one_for_postprocess(server, receiver):
    trace_id = f"{0x5656:032x}"
    answer = tfs_rest(server, "image", "image_bytes", PHOTOS[:1],
                      headers={"traceparent": f"00-{trace_id}-{0x56:016x}-01"})
    assert answer.status_code == 200

    def spans():
        found = {span.name: span for span in receiver.spans if span.trace_id.hex() == trace_id}
        return found if {"preprocess", "postprocess", "encode"} <= set(found) else None

    found = wait_for(spans, what="the request's spans")
    request = next(span for span in found.values() if span.kind == span.SPAN_KIND_SERVER)
    for name in ("decode", "preprocess", "queue wait", "postprocess", "encode"):
        assert found[name].parent_span_id == request.span_id, name
    order = [found[name] for name in ("decode", "preprocess", "queue wait", "postprocess", "encode")]
    for earlier, later in zip(order, order[1:], strict=False):
        assert earlier.end_time_unix_nano <= later.start_time_unix_nano, (earlier.name, later.name)


def test_the_payload_log_holds_what_the_client_sent_and_what_it_got(server, models):
    import tensorflow as tf

    answer = tfs_rest(server, "image", "image_bytes", PHOTOS[:2], headers={"X-Request-ID": "payload-56"})
    got = rows_of(answer)

    def logged():
        try:
            files = read_records(Path(server.env["PAYLOAD_LOG_DIR"]))
        except Exception:  # a record being written: read again
            return None
        for records in files.values():
            for record in records:
                if record.predict_log.request.inputs and record.log_metadata.model_spec.name == "image":
                    inputs = tf.make_ndarray(record.predict_log.request.inputs["image_bytes"])
                    if list(inputs) == PHOTOS[:2]:
                        return record
        return None

    record = wait_for(logged, what="the payload log's record")
    outputs = record.predict_log.response.outputs
    assert [[label.decode() for label in row] for row in tf.make_ndarray(outputs["labels"])] == \
        [list(row) for row in got["labels"]]
    np.testing.assert_array_equal(tf.make_ndarray(outputs["scores"]), np.asarray(got["scores"], np.float32))
