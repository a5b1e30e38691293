"""TF Serving's own test models (their structure, built by scripts/tfs_models.py) loaded without a
server, and refused by one: how each loads, is described and batched. What they answer when
served, beyond model_servers/tensorflow_model_server_test.py's own tests, is asked in
test_tfs_model_server.py, of the one server there that serves them all.

Each expected value is the model's own arithmetic (half_plus_two: y = 0.5 x + 2), exact in float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from app.core import models
from tests.tfs_models import (
    HALF_PLUS_TWO_SIGNATURES,
    VERSION,
    dims,
    tfs_models,  # noqa: F401  (a fixture)
)

TIMEOUT_S = 60

# -- a model that cannot load ----------------------------------------------------------------


def test_bad_half_plus_two_is_refused_at_start_with_the_reason(tfs_models, start_server):  # noqa: F811
    """TF Serving keeps running and answers FAILED_PRECONDITION for it; this server refuses to
    start with a model it cannot load, naming why."""
    with pytest.raises(models.ModelLoadError, match="holds no saved_model.pb or saved_model.pbtxt"):
        models.load_model(str(tfs_models["bad_half_plus_two"]), name="bad")
    with pytest.raises(RuntimeError, match="holds no saved_model.pb or saved_model.pbtxt"):
        start_server({"MODEL_PATH": str(tfs_models["bad_half_plus_two"])})


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
    """The same documents as the served ones, from app.wire.metadata directly (REST JSON and gRPC proto)."""
    from google.protobuf import json_format

    from app.wire import metadata

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

    from app.wire import tensor_proto

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
