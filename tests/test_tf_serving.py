"""TensorFlow Serving's REST API, several models in one server, versions and their swap.

Request bodies are TensorFlow Serving's documented examples (its REST API guide): the
half_plus_two model, the tag/signal/sensor example in both formats, and {"b64": ...}.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import requests

from tests.conftest import REPO, Server, build_exact_model, integer_rows, wait_for

TIMEOUT_S = 60


def save_half_plus_two(path) -> None:
    import tensorflow as tf

    class HalfPlusTwo(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + 2.0}

    module = HalfPlusTwo()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def save_tag_signal_sensor(path) -> None:
    import tensorflow as tf

    class Example(tf.Module):
        @tf.function(input_signature=[
            tf.TensorSpec([None], tf.string, name="tag"),
            tf.TensorSpec([None, 5], tf.float32, name="signal"),
            tf.TensorSpec([None, 2, 2], tf.float32, name="sensor"),
        ])
        def serve(self, tag, signal, sensor):
            return {
                "tag_length": tf.strings.length(tag),
                "signal_sum": tf.reduce_sum(signal, axis=1),
                "sensor_max": tf.reduce_max(sensor, axis=[1, 2]),
            }

    module = Example()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def save_bytes_echo(path) -> None:
    import tensorflow as tf

    class Echo(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="image_bytes")])
        def serve(self, image_bytes):
            return {"length": tf.strings.length(image_bytes), "echo_bytes": image_bytes}

    module = Echo()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def build_multi_io_model():
    """Two named inputs, two named outputs, small integer weights (exact float32)."""
    import keras

    rng = np.random.default_rng(11)
    a, b = keras.Input((3,), name="a"), keras.Input((2,), name="b")
    joined = keras.layers.Concatenate()([a, b])
    score_layer, prob_layer = keras.layers.Dense(2, name="score"), keras.layers.Dense(1, name="prob")
    model = keras.Model({"a": a, "b": b}, {"score": score_layer(joined), "prob": prob_layer(joined)})
    score_layer.set_weights([rng.integers(-3, 4, (5, 2)).astype("float32"), np.zeros(2, "float32")])
    prob_layer.set_weights([rng.integers(-3, 4, (5, 1)).astype("float32"), np.ones(1, "float32")])
    return model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, exact_model_path):
    from scripts.export_saved_model import export

    root = tmp_path_factory.mktemp("tfs")
    export(str(exact_model_path), root / "swap", 1)  # the version swap's model: version 2 comes later
    save_half_plus_two(root / "half_plus_two" / "1")
    save_tag_signal_sensor(root / "example")
    save_bytes_echo(root / "echo")
    build_multi_io_model().save(root / "multi.keras")
    config = {
        "default": "exact",
        "models": [
            {"name": "exact", "path": str(exact_model_path), "max_batch_size": 8, "batch_timeout_ms": 1000},
            {"name": "half_plus_two", "path": str(root / "half_plus_two"), "max_batch_size": 4},
            {"name": "example", "path": str(root / "example")},
            {"name": "echo", "path": str(root / "echo")},
            {"name": "multi", "path": str(root / "multi.keras")},
            {"name": "swap", "path": str(root / "swap")},
        ],
    }
    (root / "models.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    # Polled often: the version swap waits for its new version to be found.
    running = Server(tmp_path_factory.mktemp("tfs-logs"), {"MODEL_CONFIG": str(model_dir / "models.json"),
                                                          "MODEL_POLL_SECONDS": "0.2"}).start()
    yield running
    running.stop()


def post(server, path: str, body) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=TIMEOUT_S)


def test_half_plus_two_answers_as_documented(server):
    answer = post(server, "/v1/models/half_plus_two:predict", {"instances": [1.0, 2.0, 5.0]})
    assert answer.status_code == 200
    assert answer.json() == {"predictions": [2.5, 3.0, 4.5]}
    versioned = post(server, "/v1/models/half_plus_two/versions/1:predict", {"instances": [1.0, 2.0, 5.0]})
    assert versioned.json() == {"predictions": [2.5, 3.0, 4.5]}


def test_documented_row_format_example_with_named_inputs(server):
    body = {"instances": [
        {"tag": "foo", "signal": [1, 2, 3, 4, 5], "sensor": [[1, 2], [3, 4]]},
        {"tag": "bar", "signal": [3, 4, 1, 2, 5], "sensor": [[4, 5], [6, 8]]},
    ]}
    answer = post(server, "/v1/models/example:predict", body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [
        {"sensor_max": 4.0, "signal_sum": 15.0, "tag_length": 3},
        {"sensor_max": 8.0, "signal_sum": 15.0, "tag_length": 3},
    ]}


def test_documented_columnar_example_with_named_inputs(server):
    body = {"inputs": {
        "tag": ["foo", "bar"],
        "signal": [[1, 2, 3, 4, 5], [3, 4, 1, 2, 5]],
        "sensor": [[[1, 2], [3, 4]], [[4, 5], [6, 8]]],
    }}
    answer = post(server, "/v1/models/example:predict", body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"outputs": {"sensor_max": [4.0, 8.0], "signal_sum": [15.0, 15.0], "tag_length": [3, 3]}}


def test_b64_values_in_and_out(server):
    raw = [b"\xff\x00\x01binary", b"plain text"]
    body = {"instances": [{"b64": base64.b64encode(raw[0]).decode()}, "plain text"]}
    answer = post(server, "/v1/models/echo:predict", body)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"predictions": [
        {"echo_bytes": {"b64": base64.b64encode(raw[0]).decode()}, "length": len(raw[0])},
        # An output named *_bytes is always base64 (TF Serving's json_tensor.cc IsNamedTensorBytes).
        {"echo_bytes": {"b64": base64.b64encode(raw[1]).decode()}, "length": len(raw[1])},
    ]}
    bad = post(server, "/v1/models/echo:predict", {"instances": [{"b64": "not base64!"}]})
    assert bad.status_code == 400
    assert "not valid base64" in bad.json()["error"]


def test_multi_input_multi_output_keras_model_round_trips_in_both_formats(server):
    model = build_multi_io_model()
    a = integer_rows(3, features=3, seed=1)
    b = integer_rows(3, features=2, seed=2)
    expected = {name: value.numpy() for name, value in model({"a": a, "b": b}).items()}

    rows = post(server, "/v1/models/multi:predict",
                {"instances": [{"a": a[i].tolist(), "b": b[i].tolist()} for i in range(3)]})
    assert rows.status_code == 200, rows.text
    assert rows.json() == {"predictions": [
        {"prob": expected["prob"][i].tolist(), "score": expected["score"][i].tolist()} for i in range(3)]}

    columns = post(server, "/v1/models/multi:predict", {"inputs": {"a": a.tolist(), "b": b.tolist()}})
    assert columns.status_code == 200, columns.text
    assert columns.json() == {"outputs": {"prob": expected["prob"].tolist(), "score": expected["score"].tolist()}}


def test_metadata_matches_the_model(server):
    answer = requests.get(server.url + "/v1/models/example/metadata", timeout=TIMEOUT_S)
    assert answer.status_code == 200
    document = answer.json()
    assert document["model_spec"] == {"name": "example", "signature_name": "", "version": "1"}
    signature = document["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["method_name"] == "tensorflow/serving/predict"

    def dims(tensor):
        return [int(dim["size"]) for dim in tensor["tensor_shape"]["dim"]]

    inputs, outputs = signature["inputs"], signature["outputs"]
    assert {name: (t["dtype"], dims(t)) for name, t in inputs.items()} == {
        "tag": ("DT_STRING", [-1]), "signal": ("DT_FLOAT", [-1, 5]), "sensor": ("DT_FLOAT", [-1, 2, 2])}
    assert {name: (t["dtype"], dims(t)) for name, t in outputs.items()} == {
        "tag_length": ("DT_INT32", [-1]), "signal_sum": ("DT_FLOAT", [-1]), "sensor_max": ("DT_FLOAT", [-1])}


def test_model_status_as_tf_serving_reports_it(server):
    answer = requests.get(server.url + "/v1/models/half_plus_two", timeout=TIMEOUT_S)
    assert answer.json() == {"model_version_status": [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}


def test_each_model_is_batched_separately_with_its_own_settings(server, exact_model):
    status = requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()["models"]
    assert sorted(status) == ["echo", "exact", "example", "half_plus_two", "multi", "swap"]
    assert (status["exact"]["max_batch_size"], status["exact"]["batch_timeout_ms"]) == (8, 1000)
    assert (status["half_plus_two"]["max_batch_size"], status["half_plus_two"]["batch_timeout_ms"]) == (4, 0)
    # "exact" waits up to 1 s for a batch of 8: six requests to it and six to half_plus_two
    # at once. Its batches can only hold its own requests.
    exact_bodies = [integer_rows(1, seed=i) for i in range(6)]
    start = threading.Barrier(12)

    def send(path, body):
        start.wait(TIMEOUT_S)
        return post(server, path, body)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        exact_answers = [pool.submit(send, "/predict", {"instances": rows.tolist()}) for rows in exact_bodies]
        half_answers = [pool.submit(send, "/v1/models/half_plus_two:predict", {"instances": [float(i)]})
                        for i in range(6)]
        exact_answers = [future.result(TIMEOUT_S) for future in exact_answers]
        half_answers = [future.result(TIMEOUT_S) for future in half_answers]
    for rows, answer in zip(exact_bodies, exact_answers, strict=True):
        assert answer.json()["predictions"] == exact_model(rows).numpy().tolist()
        assert 1 <= int(answer.headers["X-Batch-Requests"]) <= 6
    assert max(int(answer.headers["X-Batch-Requests"]) for answer in exact_answers) > 1
    assert [answer.json()["predictions"] for answer in half_answers] == [[0.5 * i + 2] for i in range(6)]
    assert all(int(answer.headers["X-Batch-Size"]) <= 4 for answer in half_answers)


def export_version(model_path, base, version: int) -> None:
    """The documented export command, run as a user runs it."""
    subprocess.run([sys.executable, "scripts/export_saved_model.py", "--model", str(model_path), "--base", str(base),
                    "--version", str(version)], cwd=REPO, check=True, capture_output=True, timeout=300)


def test_exported_saved_model_serves_the_keras_models_own_output(in_process_app, exact_model_path, exact_model,
                                                                 tmp_path):
    export_version(exact_model_path, tmp_path / "base", 1)
    assert sorted(p.name for p in (tmp_path / "base").iterdir()) == ["1"]
    # Served in-process: what is under test is the export and its loading, not Gunicorn.
    app = in_process_app(model_path=str(tmp_path / "base"))
    rows = integer_rows(7, seed=5)
    answer = app.test_client().post("/predict", json={"instances": rows.tolist()})
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Model-Version"] == "1"
    np.testing.assert_array_equal(np.asarray(answer.json["predictions"], np.float32), exact_model(rows).numpy())


def test_new_version_is_swapped_in_under_load_without_a_failed_request(server, model_dir, exact_model_path,
                                                                       tmp_path):
    # The command's own function, in this process: the command is the test above's, the swap
    # is this one's (two more TensorFlow imports in subprocesses cost about 10 s). The model
    # 'swap' of the module's server is version 1 of the exact model; version 2 is exported
    # under load, and removed again at the end, so that the server is left as it was found.
    from scripts.export_saved_model import export

    base = model_dir / "swap"
    second = build_exact_model(seed=8)
    second.save(tmp_path / "second.keras")
    expected = {"1": build_exact_model(), "2": second}
    url = server.url + "/v1/models/swap:predict"

    stop = threading.Event()
    answers: list[tuple[np.ndarray, requests.Response]] = []

    def load(seed: int) -> None:
        give_up = time.monotonic() + 180
        with requests.Session() as session:
            for i in range(50_000):  # bounded in count and time; the test stops it much sooner
                if stop.is_set() or time.monotonic() > give_up:
                    return
                rows = integer_rows(1 + i % 3, seed=seed * 10_000 + i)
                answers.append((rows, session.post(url, json={"instances": rows.tolist()}, timeout=TIMEOUT_S)))

    def swap_version() -> int:
        return requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()["models"]["swap"]["version"]

    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            clients = [pool.submit(load, seed) for seed in range(4)]
            export(str(tmp_path / "second.keras"), base, 2)
            deadline = time.monotonic() + 120
            while sum(answer.headers.get("X-Model-Version") == "2" for _, answer in list(answers)) < 50:
                assert time.monotonic() < deadline, "v2 never served"
                for client in clients:
                    if client.done():
                        client.result()  # a client that ended early raised: show why
                time.sleep(0.05)  # the clients' answers are the signal; nothing to block on
            stop.set()
            for client in clients:
                client.result(TIMEOUT_S)

        versions = [answer.headers.get("X-Model-Version") for _, answer in answers]
        assert [answer.status_code for _, answer in answers] == [200] * len(answers)
        assert set(versions) == {"1", "2"}
        # Every answer is exactly the output of the version that says it answered.
        for rows, answer in answers:
            version = answer.headers["X-Model-Version"]
            assert answer.json()["predictions"] == expected[version](rows).numpy().tolist()
        assert swap_version() == 2
    finally:
        stop.set()
        shutil.rmtree(base / "2", ignore_errors=True)
    wait_for(lambda: swap_version() == 1, what="version 1 of 'swap' served again")
