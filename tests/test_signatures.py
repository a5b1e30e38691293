"""Signatures, TF1 SavedModels, :classify and :regress, against a live server.

half_plus_three is built here as TF Serving builds its test model
(servables/tensorflow/testdata/saved_model_half_plus_two.py): a TF1 graph with a
placeholder of serialized tf.Examples, tf.compat.v1 signatures for predict, regress and
classify, saved by SavedModelBuilder into the version folder 00000123, as in
testdata/saved_model_half_plus_three/00000123. The curl lines are g3doc/api_rest.md's,
sent as written (no Content-Type). Every expected value is exact in float32.
"""

from __future__ import annotations

import json
import threading

import pytest
import requests

from tests.conftest import Server

TIMEOUT_S = 60


def save_half_plus_three_tf1(path) -> None:
    """y = 0.5 * x + 3, from a tf.Example feature x, in a TF1 graph (no tf.function anywhere)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a, c = v1.Variable(0.5, name="a"), v1.Variable(3.0, name="c")
        serialized = v1.placeholder(tf.string, shape=[None], name="tf_example")
        parsed = v1.io.parse_example(serialized, {"x": v1.io.FixedLenFeature([1], tf.float32)})
        x = tf.identity(parsed["x"], name="x")
        y = tf.identity(a * x + c, name="y")
        classes = tf.identity(tf.tile(tf.constant([["below", "above"]]), [tf.shape(x)[0], 1]), name="classes")
        scores = tf.concat([-y, y], axis=1, name="scores")
        session.run(v1.global_variables_initializer())
        builder = v1.saved_model.Builder(str(path))
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
            "serving_default": v1.saved_model.predict_signature_def({"x": x}, {"y": y}),
            "tensorflow/serving/regress": v1.saved_model.regression_signature_def(serialized, y),
            "classify_x_to_y": v1.saved_model.classification_signature_def(serialized, classes, scores),
        })
        builder.save()


def save_multi_signature(path) -> None:
    """Two predict signatures with different inputs: serving_default (x -> y = 0.5 x + 2) and
    'triple' (z -> w = 3 z), so an answer from the wrong signature cannot pass."""
    import tensorflow as tf

    class Multi(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def half_plus_two(self, x):
            return {"y": 0.5 * x + 2.0}

        @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="z")])
        def triple(self, z):
            return {"w": 3.0 * z}

    module = Multi()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.half_plus_two,
                                                       "triple": module.triple})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("signatures")
    save_half_plus_three_tf1(root / "half_plus_three" / "00000123")
    (root / "half_plus_three" / "not-a-version").mkdir()  # TF Serving ignores it; so must we
    save_multi_signature(root / "multi" / "1")
    config = {"models": [
        {"name": "half_plus_three", "path": str(root / "half_plus_three")},
        # A long batch window: requests of both signatures wait together, yet never share a batch.
        {"name": "multi", "path": str(root / "multi"), "max_batch_size": 8, "batch_timeout_ms": 300},
    ]}
    (root / "models.json").write_text(json.dumps(config))
    running = Server(tmp_path_factory.mktemp("signatures-logs"), {
        "MODEL_CONFIG": str(root / "models.json"), "MODEL_POLL_SECONDS": "0"}).start()
    yield running
    running.stop()




def post(server, path: str, body) -> requests.Response:
    return requests.post(server.url + path, data=json.dumps(body), timeout=TIMEOUT_S)


def test_tf1_half_plus_three_in_folder_00000123_answers_the_documented_curl_lines(server):
    """g3doc/api_rest.md, section Example: status, predict and regress, verbatim. The version
    folder 00000123 is version 123 (storage_path.cc reads version folders as numbers)."""
    status = server.curl("curl http://localhost:8501/v1/models/half_plus_three")
    assert json.loads(status) == {"model_version_status": [
        {"version": "123", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}
    predict = server.curl("curl -d '{\"instances\": [1.0,2.0,5.0]}' -X POST "
                           "http://localhost:8501/v1/models/half_plus_three:predict")
    assert json.loads(predict) == {"predictions": [3.5, 4.0, 5.5]}
    regress = server.curl("curl -d '{\"signature_name\": \"tensorflow/serving/regress\", \"examples\": "
                           "[{\"x\": 1.0}, {\"x\": 2.0}]}' -X POST "
                           "http://localhost:8501/v1/models/half_plus_three:regress")
    assert json.loads(regress) == {"results": [3.5, 4.0]}
    by_version = post(server, "/v1/models/half_plus_three/versions/123:predict", {"instances": [7.0]})
    assert by_version.json() == {"predictions": [6.5]}


def test_classify_answers_label_score_pairs_with_context_merged(server):
    """util/json_tensor.cc: MakeJsonFromClassificationResult writes {"results": [[[label, score]]]};
    FillClassifyRegressRequestFromJson merges "context" into each example."""
    answer = post(server, "/v1/models/half_plus_three:classify",
                  {"signature_name": "classify_x_to_y", "examples": [{"x": 1.0}, {"x": -8.0}]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"results": [[["below", -3.5], ["above", 3.5]], [["below", 1.0], ["above", -1.0]]]}
    with_context = post(server, "/v1/models/half_plus_three:regress",
                        {"signature_name": "tensorflow/serving/regress", "context": {"x": 4.0}, "examples": [{}, {}]})
    assert with_context.json() == {"results": [5.0, 5.0]}


@pytest.mark.parametrize("path,body,message", [
    # servables/tensorflow/classifier.cc and regressor.cc, without the method-name check (TF
    # Serving's default): the signature's input must be 'inputs', its outputs classify's or regress's.
    ("/v1/models/half_plus_three:classify", {"examples": [{"x": 1.0}]},
     "No classification inputs found in SignatureDef 'serving_default'"),
    ("/v1/models/half_plus_three:regress", {"signature_name": "classify_x_to_y", "examples": [{"x": 1.0}]},
     "Expected one output Tensor."),
    ("/v1/models/multi:regress", {"examples": [{"x": 1.0}]},
     "No regression inputs found in SignatureDef 'serving_default'"),
    ("/v1/models/half_plus_three:regress", {"signature_name": "nope", "examples": [{"x": 1.0}]},
     "No signature was found with the name: nope"),
    # util/json_tensor.cc, FillClassifyRegressRequestFromJson.
    ("/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress"},
     "When method is regress, key 'examples' is expected and was not found"),
    ("/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress", "examples": []},
     "'examples' value is an empty array"),
    ("/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress", "examples": [[1.0]]},
     "Example must be JSON object"),
    ("/v1/models/half_plus_three:regress", {"signature_name": "tensorflow/serving/regress",
                                            "examples": [{"x": [1.0, 2]}]}, "mixes float and int64"),
])
def test_classify_and_regress_refuse_as_tf_serving_does(server, path, body, message):
    answer = post(server, path, body)
    assert answer.status_code == 400
    assert message in answer.json()["error"]


def test_a_missing_example_feature_is_the_models_error_not_a_hang(server):
    """The graph's parse_example refuses an example without x: that request fails alone."""
    answer = post(server, "/v1/models/half_plus_three:regress",
                  {"signature_name": "tensorflow/serving/regress", "examples": [{"y": 1.0}]})
    assert answer.status_code == 500
    assert "InvalidArgument" in answer.json()["error"]


def test_signature_name_selects_any_signature_and_empty_means_serving_default(server):
    """g3doc/api_rest.md: signature_name is optional; http_rest_api_handler.cc GetInfoMap reads ""
    as serving_default and answers an unknown one 'Serving signature name: "..." not found'."""
    default = post(server, "/v1/models/multi:predict", {"instances": [1.0, 4.0]})
    assert default.json() == {"predictions": [2.5, 4.0]}
    empty = post(server, "/v1/models/multi:predict", {"signature_name": "", "instances": [1.0, 4.0]})
    assert empty.json() == {"predictions": [2.5, 4.0]}
    triple = post(server, "/v1/models/multi:predict", {"signature_name": "triple", "inputs": {"z": [[1, 2]]}})
    assert triple.status_code == 200, triple.text
    assert triple.json() == {"outputs": [[3.0, 6.0]]}
    unknown = post(server, "/v1/models/multi:predict", {"signature_name": "train", "instances": [1.0]})
    assert unknown.status_code == 400
    assert unknown.json()["error"].startswith('Serving signature name: "train" not found in signature def')


def test_metadata_lists_every_signature_with_its_method(server):
    """get_model_metadata_impl.cc: the signature_def map holds every signature of the version."""
    document = requests.get(server.url + "/v1/models/half_plus_three/metadata", timeout=TIMEOUT_S).json()
    assert document["model_spec"] == {"name": "half_plus_three", "signature_name": "", "version": "123"}
    signatures = document["metadata"]["signature_def"]["signature_def"]

    def dims(tensor):
        return [int(dim["size"]) for dim in tensor["tensor_shape"]["dim"]]

    summary = {key: (s["method_name"], {n: (t["dtype"], dims(t)) for n, t in s["inputs"].items()},
                     {n: (t["dtype"], dims(t)) for n, t in s["outputs"].items()}) for key, s in signatures.items()}
    assert summary == {
        "serving_default": ("tensorflow/serving/predict", {"x": ("DT_FLOAT", [-1, 1])}, {"y": ("DT_FLOAT", [-1, 1])}),
        "tensorflow/serving/regress": ("tensorflow/serving/regress", {"inputs": ("DT_STRING", [-1])},
                                       {"outputs": ("DT_FLOAT", [-1, 1])}),
        "classify_x_to_y": ("tensorflow/serving/classify", {"inputs": ("DT_STRING", [-1])},
                            {"classes": ("DT_STRING", [-1, 2]), "scores": ("DT_FLOAT", [-1, 2])}),
    }
    multi = requests.get(server.url + "/v1/models/multi/metadata", timeout=TIMEOUT_S).json()
    assert sorted(multi["metadata"]["signature_def"]["signature_def"]) == ["serving_default", "triple"]


def test_requests_of_different_signatures_never_share_a_batch(server):
    """Three requests to each signature inside one 300 ms batch window: each signature's
    requests batch together, and no batch mixes the two (one batcher per signature)."""
    start = threading.Barrier(6)

    def send(body):
        start.wait(TIMEOUT_S)
        return post(server, "/v1/models/multi:predict", body)

    bodies = [{"instances": [float(i)]} for i in range(3)] + \
             [{"signature_name": "triple", "instances": [[float(i), 1.0]]} for i in range(3)]
    answers = [None] * 6
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, send(bodies[i]))) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert [a.json() for a in answers] == [{"predictions": [0.5 * i + 2]} for i in range(3)] + \
                                          [{"predictions": [[3.0 * i, 3.0]]} for i in range(3)]
    sizes = [int(a.headers["X-Batch-Requests"]) for a in answers]
    assert all(size <= 3 for size in sizes)
    status = requests.get(server.url + "/readyz", timeout=TIMEOUT_S).json()["models"]["multi"]
    assert status["signatures"] == ["serving_default", "triple"]
