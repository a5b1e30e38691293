"""Keras 3's JAX backend (KERAS_BACKEND=jax): the same `.keras` files, served alike on both backends.

One server per backend, sharing one MODEL_CONFIG: the built-in default model (split over two
batches), a model of two inputs and two outputs, a variable-length masking model padded to length
buckets, and a SavedModel of two versions with labels (TensorFlow serves it on both). Every
protocol's answer of the JAX server is compared with the TensorFlow server's for the same
request, and the TensorFlow server's with the file's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests

from examples.text_classifier import handler as text_handler
from examples.text_classifier import model as text_classifier
from scripts.text_model import build_text_model, token_rows
from tests.conftest import REPO, Server
from tests.test_tf_serving import build_multi_io_model
from tests.test_versions import save_half_plus

# JAX lives in a venv of its own (.ci/run makes it: requirements-jax.txt and a .pth file onto the
# project venv's site-packages): installed beside TensorFlow, `import tensorflow` imports it too,
# and every server process the other tests start would pay for that (a third of the import).
JAX_VENV = Path(os.environ.get("JAX_VENV", REPO / ".venv-jax"))
JAX_PYTHON = str(JAX_VENV / "bin" / "python")
pytestmark = pytest.mark.skipif(not Path(JAX_PYTHON).exists(), reason=f"no venv with JAX at {JAX_VENV}")

TIMEOUT_S = 60
# float32 through two compilers (XLA's and TensorFlow's kernels sum in different orders).
RTOL, ATOL = 1e-5, 1e-6
ALLOCATOR = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
LENGTHS = (2, 5, 7)


def build_wide_model():
    """An int64 input and a float64 one, each answered as given (Keras's layers cast the float64 to float32)."""
    import keras

    ids, x = keras.Input((1,), dtype="int64", name="ids"), keras.Input((1,), dtype="float64", name="x")
    return keras.Model({"ids": ids, "x": x}, {"ids_out": keras.layers.Identity(name="same_ids")(ids),
                                              "x_out": keras.layers.Identity(name="same_x")(x)})


def keras_inputs() -> dict[str, dict[str, np.ndarray]]:
    """One request's inputs per Keras model (the masking model's are per length, below)."""
    rng = np.random.default_rng(5)
    return {
        # Six rows, MAX_BATCH_SIZE 4: split over two calls.
        "default": {"features": rng.normal(size=(6, 4)).astype("float32")},
        "multi": {"a": rng.integers(-5, 6, (3, 3)).astype("float32"),
                  "b": rng.integers(-5, 6, (3, 2)).astype("float32")},
    }


@pytest.fixture(scope="module")
def model_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("jax-models")
    build_multi_io_model().save(root / "multi.keras")
    build_text_model().save(root / "text.keras")
    build_wide_model().save(root / "wide.keras")
    text_classifier.build().save(root / "classifier.keras")
    for version in (1, 2):
        save_half_plus(root / "half" / str(version), float(version))
    config = {"default": "default", "models": [
        {"name": "default", "max_batch_size": 4},
        {"name": "multi", "path": str(root / "multi.keras")},
        {"name": "text", "path": str(root / "text.keras"), "pad_variable_length": "true", "length_buckets": "4,8",
         "batch_timeout_ms": 200},
        {"name": "half", "path": str(root / "half"), "model_version_policy": {"all": {}},
         "version_labels": {"stable": 1, "canary": 2}},
        {"name": "wide", "path": str(root / "wide.keras")},
        # A handler's model: its custom layer loads on either backend through the handler's custom_objects.
        {"name": "classifier", "path": str(root / "classifier.keras"), "handler": "examples.text_classifier.handler"},
    ]}
    (root / "models.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_root):
    """{"tensorflow": Server, "jax": Server}, started side by side."""
    logs = tmp_path_factory.mktemp("jax-logs")
    common = {"MODEL_CONFIG": str(model_root / "models.json")}
    started = {"tensorflow": Server(logs, {**common, "KERAS_BACKEND": "tensorflow"}),
               "jax": Server(logs, {**common, "KERAS_BACKEND": "jax", "GPU_MEMORY_FRACTION": "0.25"},
                                 python=JAX_PYTHON)}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda server: server.start(), started.values()))
        yield started
    finally:
        for server in started.values():
            if server.proc is not None:
                server.stop()


@pytest.fixture(scope="module")
def own_outputs(model_root):
    """What each Keras file answers by itself, in this process (TensorFlow's backend)."""
    import keras

    from app.core.models import build_default_model

    models = {"default": build_default_model(),
              "multi": keras.models.load_model(model_root / "multi.keras", compile=False),
              "text": keras.models.load_model(model_root / "text.keras", compile=False)}
    answers = {name: models[name](inputs["features"] if name == "default" else inputs)
               for name, inputs in keras_inputs().items()}
    answers.update({("text", length): models["text"](token_rows(length, length)) for length in LENGTHS})
    return {key: {name: np.asarray(value) for name, value in (answer.items() if isinstance(answer, dict)
                                                               else [("scores", answer)])}
            for key, answer in answers.items()}


def requests_by_model() -> list[tuple[str, object, dict[str, np.ndarray]]]:
    """(model, key into own_outputs, inputs): every Keras request the protocol tests send."""
    cases: list[tuple[str, object, dict[str, np.ndarray]]] = [
        (name, name, inputs) for name, inputs in keras_inputs().items()]
    cases += [("text", ("text", length), {"tokens": token_rows(length, length)}) for length in LENGTHS]
    return cases


def assert_alike(by_backend: dict[str, dict[str, np.ndarray]], own: dict[str, np.ndarray], *, where: str) -> None:
    """Both backends' answers have the file's outputs, and the same values within float tolerance."""
    for backend, answer in by_backend.items():
        assert sorted(answer) == sorted(own), (where, backend)
        for name, value in own.items():
            np.testing.assert_allclose(np.asarray(answer[name], dtype=value.dtype), value, rtol=RTOL, atol=ATOL,
                                       err_msg=f"{where} on {backend}: {name}")


def send_all(send, servers) -> list[dict[str, dict[str, np.ndarray]]]:
    """Each request to both servers at once, so a model's requests (the lengths) share batches."""
    cases = requests_by_model()
    with ThreadPoolExecutor(2 * len(cases)) as pool:
        futures = [{backend: pool.submit(send, server, model, inputs) for backend, server in servers.items()}
                   for model, _, inputs in cases]
        return [{backend: future.result() for backend, future in by_backend.items()} for by_backend in futures]


def test_readyz_and_the_start_up_log_name_the_backend(servers):
    for backend, server in servers.items():
        ready = requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()
        assert ready["ready"] is True
        # TensorFlow's own configuration stays as it was, under its own name.
        assert ready["tensorflow"].get("keras_backend", "tensorflow") == backend
    if not servers["jax"].model_processes:  # there the model processes hold the models, not the workers
        assert ready["tensorflow"]["jax_allocator"] == ALLOCATOR
    assert "runs on Keras's JAX backend" in servers["jax"].log()
    assert "runs on Keras's JAX backend" not in servers["tensorflow"].log()


@pytest.mark.parametrize("model", ["default", "multi", "text", "half", "wide", "classifier"])
def test_metadata_is_the_same_on_both_backends(servers, model):
    from tensorflow_serving.apis import get_model_metadata_pb2, prediction_service_pb2_grpc

    answers = {}
    for backend, server in servers.items():
        rest = requests.get(f"{server.url}/v1/models/{model}/metadata", timeout=TIMEOUT_S)
        v2 = requests.get(f"{server.url}/v2/models/{model}", timeout=TIMEOUT_S)
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        request.model_spec.name = model
        with grpc.insecure_channel(server.grpc_target) as channel:
            reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).GetModelMetadata(
                request, timeout=TIMEOUT_S)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        reply.metadata["signature_def"].Unpack(signatures)  # compared as messages: maps in any order
        answers[backend] = (rest.status_code, rest.json(), v2.status_code, v2.json(), reply.model_spec, signatures)
    assert answers["jax"] == answers["tensorflow"]
    assert answers["jax"][0] == answers["jax"][2] == 200


def rest_predict(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """TF Serving's row format, one instance per row (a bare list where there is one input)."""
    rows = ([row.tolist() for row in next(iter(inputs.values()))] if len(inputs) == 1 else
            [{name: value[index].tolist() for name, value in inputs.items()}
             for index in range(len(next(iter(inputs.values()))))])
    answer = requests.post(f"{server.url}/v1/models/{model}:predict", json={"instances": rows}, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    predictions = answer.json()["predictions"]
    if isinstance(predictions[0], dict):
        return {name: np.array([row[name] for row in predictions]) for name in predictions[0]}
    return {"scores": np.array(predictions)}


def rest_columns(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """TF Serving's columnar format."""
    body = {"inputs": {name: value.tolist() for name, value in inputs.items()}}
    answer = requests.post(f"{server.url}/v1/models/{model}:predict", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    outputs = answer.json()["outputs"]
    return {name: np.array(value) for name, value in outputs.items()} if isinstance(outputs, dict) else \
        {"scores": np.array(outputs)}


def grpc_predict(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tensorflow as tf
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for name, value in inputs.items():
        request.inputs[name].CopyFrom(tf.make_tensor_proto(value))
    with grpc.insecure_channel(server.grpc_target) as channel:
        reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=TIMEOUT_S)
    return {name: tf.make_ndarray(proto) for name, proto in reply.outputs.items()}


def v2_rest(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    datatypes = {"float32": "FP32", "int32": "INT32"}
    body = {"inputs": [{"name": name, "shape": list(value.shape), "datatype": datatypes[value.dtype.name],
                        "data": value.ravel().tolist()} for name, value in inputs.items()]}
    answer = requests.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return {output["name"]: np.array(output["data"]).reshape(output["shape"]) for output in answer.json()["outputs"]}


def v2_grpc(server, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tritonclient.grpc as grpcclient

    tensors = []
    for name, value in inputs.items():
        tensor = grpcclient.InferInput(name, list(value.shape), {"float32": "FP32", "int32": "INT32"}[value.dtype.name])
        tensor.set_data_from_numpy(value)
        tensors.append(tensor)
    client = grpcclient.InferenceServerClient(server.grpc_target)
    try:
        result = client.infer(model, tensors, client_timeout=TIMEOUT_S)
    finally:
        client.close()
    return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}


@pytest.mark.parametrize("send", [rest_predict, rest_columns, grpc_predict, v2_rest, v2_grpc])
def test_every_protocol_answers_alike_on_both_backends(servers, own_outputs, send):
    """Row for row, within float tolerance, and each backend as the file answers by itself."""
    for (model, key, _), by_backend in zip(requests_by_model(), send_all(send, servers), strict=True):
        assert_alike(by_backend, own_outputs[key], where=model)


def test_a_handled_model_with_a_custom_layer_answers_alike_on_both_backends(servers, model_root):
    import keras

    model = keras.models.load_model(model_root / "classifier.keras", compile=False,
                                    custom_objects=text_handler.custom_objects())
    texts, parameters = [b"fresh milk", b"a loaf of rye bread"], {"temperature": 0.5}
    inputs = text_handler.preprocess({"text": np.array(texts, dtype=object)}, parameters)
    own = text_handler.postprocess({"probabilities": np.asarray(model(inputs))}, {}, parameters)
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": [text.decode() for text in texts]}],
            "parameters": parameters}
    for backend, server in servers.items():
        answer = requests.post(f"{server.url}/v2/models/classifier/infer", json=body, timeout=TIMEOUT_S)
        assert answer.status_code == 200, (backend, answer.text)
        outputs = {output["name"]: output["data"] for output in answer.json()["outputs"]}
        assert outputs["label"] == [label.decode() for label in own["label"]], backend
        np.testing.assert_allclose(np.reshape(outputs["probabilities"], (2, 4)), own["probabilities"], rtol=RTOL,
                                   atol=ATOL, err_msg=backend)


def test_versions_and_labels_of_a_saved_model_answer_on_the_jax_server(servers):
    """SavedModels keep TensorFlow beside JAX's .keras models: 0.5 x + version."""
    server = servers["jax"]
    for path, version, want in [("/v1/models/half/versions/1", "1", [1.5, 3.0]),
                                ("/v1/models/half/labels/canary", "2", [2.5, 4.0]),
                                ("/v1/models/half", "2", [2.5, 4.0])]:
        answer = requests.post(f"{server.url}{path}:predict", json={"instances": [1.0, 4.0]}, timeout=TIMEOUT_S)
        assert (answer.status_code, answer.headers["X-Model-Version"], answer.json()) == (
            200, version, {"predictions": want}), path


BAD_REQUESTS = {
    "wrong-row-shape": ("/v1/models/default:predict", {"instances": [[1.0, 2.0, 3.0]]}),
    "strings-for-floats": ("/v1/models/multi:predict", {"instances": [{"a": ["x", "y", "z"], "b": [1.0, 2.0]}]}),
    "missing-input": ("/v1/models/multi:predict", {"instances": [{"a": [1.0, 2.0, 3.0]}]}),
    "too-many-rows": ("/v1/models/default:predict", {"instances": [[1.0] * 4] * 9}),
    "ragged-lengths": ("/v1/models/text:predict", {"instances": [[1, 2], [1, 2, 3]]}),
    "unknown-label": ("/v1/models/half/labels/beta:predict", {"instances": [1.0]}),
    "unknown-model": ("/v1/models/nothing:predict", {"instances": [1.0]}),
    "v2-wrong-shape": ("/v2/models/default/infer",
                       {"inputs": [{"name": "features", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}]}),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_the_same_error_on_both_backends(servers, case):
    path, body = BAD_REQUESTS[case]
    answers = {backend: requests.post(server.url + path, json=body, timeout=TIMEOUT_S)
               for backend, server in servers.items()}
    seen = {backend: (answer.status_code, answer.json()) for backend, answer in answers.items()}
    assert seen["jax"] == seen["tensorflow"]
    assert 400 <= seen["jax"][0] < 500, seen["jax"]


def wide_predict(server, ids: int, x: float) -> tuple[int, dict]:
    answer = requests.post(f"{server.url}/v1/models/wide:predict", json={"instances": [{"ids": [ids], "x": [x]}]},
                           timeout=TIMEOUT_S)
    return answer.status_code, answer.json()


def test_a_64_bit_value_32_bits_cannot_hold_is_refused_on_jax_never_changed(servers):
    # Without JAX_ENABLE_X64, jax.jit computes an int64 input in int32: 2**31 + 5 was -2**31 + 5.
    big = 2**31 + 5
    assert wide_predict(servers["tensorflow"], big, 0.5) == (200, {"predictions": [{"ids_out": [big], "x_out": [0.5]}]})
    assert wide_predict(servers["jax"], big, 0.5) == (400, {"error": (
        "input 'ids': 2147483653 does not fit int32, and Keras on JAX computes this int64 input in int32 "
        "(JAX_ENABLE_X64 is off)")})
    assert wide_predict(servers["jax"], 1, 1e300) == (400, {"error": (
        "input 'x': 1e+300 does not fit float32, and Keras on JAX computes this float64 input in float32 "
        "(JAX_ENABLE_X64 is off)")})
    v2 = requests.post(f"{servers['jax'].url}/v2/models/wide/infer", timeout=TIMEOUT_S, json={"inputs": [
        {"name": "ids", "datatype": "INT64", "shape": [1, 1], "data": [-2**31 - 1]},
        {"name": "x", "datatype": "FP64", "shape": [1, 1], "data": [0.5]}]})
    assert (v2.status_code, v2.json()["error"][:40]) == (400, "input 'ids': -2147483649 does not fit in")
    # What 32 bits hold is served, alike on both backends; so is a float64 within float32's range,
    # which JAX rounds to float32 (the answer's float32 reads back as 0.1).
    for server in servers.values():
        assert wide_predict(server, -2**31, 0.25) == (200, {"predictions": [{"ids_out": [-2**31], "x_out": [0.25]}]})
        assert wide_predict(server, 1, 0.1) == (200, {"predictions": [{"ids_out": [1], "x_out": [0.1]}]})


X64_PREDICT = """
import json, sys
import numpy as np
from app.core.models import load_model
model = load_model(sys.argv[1], name="wide")
out = model.predict({"ids": np.array([[2**31 + 5]], np.int64), "x": np.array([[0.5]])})
print(json.dumps([[spec.narrowed_to for spec in model.inputs], int(out["ids_out"][0, 0])]))
"""


def test_with_jax_enable_x64_a_64_bit_input_is_computed_exactly(model_root):
    done = run_with_jax(X64_PREDICT, str(model_root / "wide.keras"), JAX_ENABLE_X64="1")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[None, None], 2**31 + 5]


def run_with_jax(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter on JAX, as a worker that holds its models (whatever MODEL_PROCESSES
    this run was given: that mode's workers hold none)."""
    inherited = {key: value for key, value in os.environ.items() if key != "MODEL_PROCESSES"}
    return subprocess.run([JAX_PYTHON, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**inherited, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2", **env})


def test_a_model_jax_cannot_hold_stops_start_up_naming_the_model_and_why(tmp_path):
    import keras

    text = keras.Input((1,), dtype="string", name="text")
    keras.Model(text, keras.layers.Identity(name="same")(text)).save(tmp_path / "strings.keras")
    done = run_with_jax("from app import create_app; create_app()",
                        MODEL_PATH=str(tmp_path / "strings.keras"), MODEL_NAME="words")
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "app.core.model_types.ModelLoadError: model 'words': tensor 'text' is string, which the JAX backend cannot "
        "hold (JAX has no string tensors); serve this model without KERAS_BACKEND=jax")


READ_CONFIGURATION = """
import json, os
from app.ops import runtime
from app.ops.settings import Settings
configured = runtime.configure(Settings.from_env(), workers=2, gpu_total_bytes=lambda ordinal: 80 * 2**30)
print(json.dumps({"returned": configured["jax_allocator"],
                  "environ": {key: os.environ[key] for key in sorted(os.environ) if key.startswith("XLA_")}}))
"""


@pytest.mark.parametrize(("env", "want"), [
    ({"GPU_MEMORY_FRACTION": "0.3"},
     {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}),
    ({}, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}),
])
def test_the_gpu_memory_cap_is_jaxs_allocator_configuration(env, want):
    """runtime.configure, which every process holding a model runs (a worker's post_fork, a model
    process's load), leaves JAX's allocator variables set before JAX starts on a GPU."""
    done = run_with_jax(READ_CONFIGURATION, **env)
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout.strip().splitlines()[-1])
    assert read == {"returned": want, "environ": want}


def test_a_memory_limit_in_mb_is_the_fraction_it_is_of_the_smallest_gpu():
    from app.ops import runtime
    from app.ops.settings import Settings

    sizes = {0: 80 * 2**30, 1: 40 * 2**30}
    settings = Settings(gpu_memory_limit_mb=10 * 1024)
    assert runtime.jax_allocator_env(settings, gpus=2, total_bytes=sizes.__getitem__, environ={}) == {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25", "XLA_PYTHON_CLIENT_PREALLOCATE": "true"}
    # Where the driver shows no GPU there is nothing to cap: memory is left to grow.
    assert runtime.jax_allocator_env(settings, gpus=0, total_bytes=sizes.__getitem__, environ={}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


COUNT_PROGRAMS = """
import json, sys
import numpy as np
from app.core.models import example_batch, load_model, warm_up
model = load_model(sys.argv[1], name="text")
counts = [model.tracing_count()]
warm_up(model, [1, 2, 4], lengths=[4, 8])
counts.append(model.tracing_count())
for rows, length in [(2, 8), (4, 1), (1, 4)]:  # bucket sizes, as the batcher pads to
    batch = example_batch(model, rows, length)
    batch["tokens"][:] = 1 + np.arange(length) % 7
    model.predict(batch)
counts.append(model.tracing_count())
model.predict(example_batch(model, 3, 5))  # off the buckets: a program of its own
counts.append(model.tracing_count())
print(json.dumps(counts))
"""


def test_warm_up_compiles_one_program_per_bucket_and_serving_compiles_none(model_root):
    """3 batch buckets x lengths 1, 4 and 8: nine programs, all built before the first request."""
    done = run_with_jax(COUNT_PROGRAMS, str(model_root / "text.keras"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [0, 9, 9, 10]
