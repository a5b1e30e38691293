"""Triton's qa models, rebuilt as SavedModels this server serves, with Triton's tensor names.

Triton's protocol tests (qa/L0_http, qa/L0_grpc and the client examples their test.sh runs) send
their requests to models of its qa repository. These generators build models of the same
interface from our own code: each `serving_default` signature takes Triton's input names
(tf.saved_model.save takes them from the TensorSpec names) and answers its output names (the
returned dict's keys). `SETTINGS` gives each the MODEL_CONFIG settings that match its
config.pbtxt.

| name | Triton's config | computes |
|---|---|---|
| simple | max_batch 8, INPUT0/1 INT32 [16] | OUTPUT0 = I0 + I1, OUTPUT1 = I0 - I1 |
| simple_int8 | the same, INT8 | the same |
| simple_string | max_batch 8, INPUT0/1 BYTES [16] | str(int(I0) + int(I1)), str(int(I0) - int(I1)) |
| simple_identity | max_batch 8, BYTES [-1] | identity |
| simple_identity_int64 | max_batch 8, INT64 [-1] | identity |
| string_identity | max_batch 0, BYTES [-1] | identity (its one dimension is our rows) |
| onnx_zero_1_float32 | max_batch 8, FP32 [-1] | identity |
| onnx_zero_1_float32_queue | as above, a 1 s batch window and a queue of 1 | identity |
| onnx_zero_1_object | max_batch 8, BYTES [-1] | identity |
| onnx_zero_1_object_1_element | max_batch 8, BYTES [1] | identity |
| onnx_zero_1_float16 | max_batch 8, FP16 [-1, -1] | identity |
| onnx_zero_3_float32 | max_batch 8, INPUT0..2 FP32 [-1] | identity of each |

A batching model's leading dimension (max_batch > 0) is our rows. `STAND_INS` are qa models
this server cannot rebuild (sequence batching, real DenseNet weights): empty folders, which
only count in the repository index, as Triton's tests count it. The tests build them
(tests/test_triton_*.py); nothing here imports pytest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# MODEL_CONFIG settings matching each Triton config.pbtxt.
SETTINGS: dict[str, dict[str, Any]] = {
    "simple": {"max_batch_size": 8},
    "simple_int8": {"max_batch_size": 8},
    "simple_string": {"max_batch_size": 8},
    "simple_identity": {"max_batch_size": 8},
    "simple_identity_int64": {"max_batch_size": 8},
    # Triton: max_batch_size 0, dims [-1]; its GrpcTest sends 10,485,760 elements in one request,
    # which are our rows: calls of 2**20 rows.
    "string_identity": {"max_batch_size": 1 << 20, "max_queue_rows": 10 << 20, "max_request_rows": 10 << 20},
    "onnx_zero_1_float32": {"max_batch_size": 8},
    # dynamic_batching {max_queue_delay_microseconds: 1000000, default_queue_policy {max_queue_size: 1}}
    "onnx_zero_1_float32_queue": {"max_batch_size": 8, "batch_timeout_ms": 1000, "max_queue_rows": 1},
    "onnx_zero_1_object": {"max_batch_size": 8},
    "onnx_zero_1_object_1_element": {"max_batch_size": 8},
    "onnx_zero_1_float16": {"max_batch_size": 8},
    "onnx_zero_3_float32": {"max_batch_size": 8},
}

STAND_INS = ("densenet_onnx", "simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence")

# The repositories of Triton's test.sh: L0_http's first server (7 models), L0_grpc's (8), and the
# explicit-mode servers of http_test.py and python_unit_test.py's GrpcTest.
L0_HTTP_REPOSITORY = ("simple", "simple_dyna_sequence", "simple_identity", "simple_sequence", "simple_string",
                      "densenet_onnx", "simple_string_dyna_sequence")
L0_GRPC_REPOSITORY = (*L0_HTTP_REPOSITORY, "simple_int8")
HTTP_TEST_MODELS = ("onnx_zero_1_float32", "onnx_zero_1_object", "onnx_zero_1_float16", "onnx_zero_3_float32",
                    "onnx_zero_1_object_1_element", "onnx_zero_1_float32_queue", "simple_identity",
                    "simple_identity_int64")
GRPC_TEST_MODELS = ("simple", "string_identity")


def _identity(tf: Any, specs: list[Any]) -> Any:
    """A module whose serving signature answers OUTPUTi = INPUTi for each spec."""

    class Identity(tf.Module):
        @tf.function(input_signature=specs)
        def serve(self, *tensors):
            return {f"OUTPUT{index}": tf.identity(tensor) for index, tensor in enumerate(tensors)}

    return Identity()


def _add_sub(tf: Any, dtype: Any) -> Any:
    class AddSub(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], dtype, name="INPUT0"),
                                      tf.TensorSpec([None, 16], dtype, name="INPUT1")])
        def serve(self, a, b):
            return {"OUTPUT0": a + b, "OUTPUT1": a - b}

    return AddSub()


def _string_add_sub(tf: Any) -> Any:
    class StringAddSub(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.string, name="INPUT0"),
                                      tf.TensorSpec([None, 16], tf.string, name="INPUT1")])
        def serve(self, a, b):
            # "" reads as 0: warm-up sends empty strings, which StringToNumber refuses.
            x = tf.strings.to_number(tf.where(a == "", "0", a), tf.int32)
            y = tf.strings.to_number(tf.where(b == "", "0", b), tf.int32)
            return {"OUTPUT0": tf.strings.as_string(x + y), "OUTPUT1": tf.strings.as_string(x - y)}

    return StringAddSub()


def modules(tf: Any) -> dict[str, Any]:
    def one(shape: list[int | None], dtype: Any) -> Any:
        return _identity(tf, [tf.TensorSpec(shape, dtype, name="INPUT0")])

    return {
        "simple": _add_sub(tf, tf.int32),
        "simple_int8": _add_sub(tf, tf.int8),
        "simple_string": _string_add_sub(tf),
        "simple_identity": one([None, None], tf.string),
        "simple_identity_int64": one([None, None], tf.int64),
        "string_identity": one([None], tf.string),
        "onnx_zero_1_float32": one([None, None], tf.float32),
        "onnx_zero_1_float32_queue": one([None, None], tf.float32),
        "onnx_zero_1_object": one([None, None], tf.string),
        "onnx_zero_1_object_1_element": one([None, 1], tf.string),
        "onnx_zero_1_float16": one([None, None, None], tf.float16),
        "onnx_zero_3_float32": _identity(tf, [tf.TensorSpec([None, None], tf.float32, name=f"INPUT{index}")
                                              for index in range(3)]),
    }


def build(out: Path) -> Path:
    """Every model as `out/<name>/1/`, and the stand-ins' empty folders; returns `out`."""
    import tensorflow as tf

    for name, module in modules(tf).items():
        target = out / name / "1"
        if not (target / "saved_model.pb").exists():
            tf.saved_model.save(module, str(target), signatures={"serving_default": module.serve})
    for name in STAND_INS:
        (out / name).mkdir(parents=True, exist_ok=True)
    return out


def repository(built: Path, folder: Path, names: tuple[str, ...]) -> Path:
    """A MODEL_REPOSITORY laid out as Triton's test.sh lays one: `folder/<name>` for each name."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        link = folder / name
        if not link.exists():
            link.symlink_to(built / name)
    return folder


def model_config(folder: Path, names: tuple[str, ...]) -> dict[str, Any]:
    """The MODEL_CONFIG document serving `names` from `folder`, each with its SETTINGS."""
    return {"default": names[0],
            "models": [{"name": name, "path": str(folder / name), **SETTINGS[name]} for name in names]}


if __name__ == "__main__":
    built = build(Path(sys.argv[1]))
    print(json.dumps(sorted(path.name for path in built.iterdir())))
