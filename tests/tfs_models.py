"""TF Serving's own test models for the tests, and the requests and checks of its test suite.

The models (their structure, built from our own code) are scripts/tfs_models.py's: the tests
build them once per session here, and examples/make_models.py builds the ones the manual
names. Every value is exact in float32, so answers compare with ==.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorflow_serving.apis import predict_pb2

# VERSION and a builder, for the test files that import them from here.
from scripts.tfs_models import VERSION, build_all, save_half_plus_two_tf2  # noqa: F401


@pytest.fixture(scope="session")
def tfs_models(tmp_path_factory) -> dict[str, Path]:
    """Built once per test session (a few seconds of TensorFlow graph building)."""
    return build_all(tmp_path_factory.mktemp("tfs_models"))


# -- the requests and checks of TF Serving's VerifyPredictRequest ------------------------------


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


def assert_y(response, expected: float, *, model: str, version: int = VERSION,
             signature_name: str = "serving_default") -> None:
    """VerifyPredictRequest's checks: y is DT_FLOAT with one value in float_val, and the model spec."""
    y = response.outputs["y"]
    assert (y.dtype, list(y.float_val), y.tensor_content) == (1, [expected], b"")
    assert (response.model_spec.name, response.model_spec.version.value, response.model_spec.signature_name) == (
        model, version, signature_name)


# -- the metadata TF Serving's testdata/half_plus_two_model_metadata.json holds ----------------


def dims(*sizes: int) -> dict:
    """A TensorShapeProto as TF Serving's REST metadata writes it."""
    return {"dim": [{"size": str(size), "name": ""} for size in sizes], "unknown_rank": False}


UNKNOWN_RANK = {"dim": [], "unknown_rank": True}


def signature_document(method: str, inputs: dict, outputs: dict) -> dict:
    """A SignatureDef as REST metadata writes it; tensors given as key -> (dtype, shape, name)."""
    def tensors(entries):
        return {key: {"dtype": dtype, "tensor_shape": shape, "name": name}
                for key, (dtype, shape, name) in entries.items()}

    return {"inputs": tensors(inputs), "outputs": tensors(outputs), "method_name": f"tensorflow/serving/{method}",
            "defaults": {}}


EXAMPLES = ("DT_STRING", UNKNOWN_RANK, "tf_example:0")
HALF_PLUS_TWO_SIGNATURES = {
    "serving_default": signature_document("predict", {"x": ("DT_FLOAT", dims(-1, 1), "x:0")},
                                          {"y": ("DT_FLOAT", dims(-1, 1), "y:0")}),
    "classify_x_to_y": signature_document("classify", {"inputs": EXAMPLES},
                                          {"scores": ("DT_FLOAT", dims(-1, 1), "y:0")}),
    "regress_x_to_y": signature_document("regress", {"inputs": EXAMPLES},
                                         {"outputs": ("DT_FLOAT", dims(-1, 1), "y:0")}),
    "regress_x_to_y2": signature_document("regress", {"inputs": EXAMPLES},
                                          {"outputs": ("DT_FLOAT", dims(-1, 1), "y2:0")}),
    "regress_x2_to_y3": signature_document("regress", {"inputs": ("DT_FLOAT", dims(-1, 1), "x2:0")},
                                           {"outputs": ("DT_FLOAT", dims(-1, 1), "y3:0")}),
}
