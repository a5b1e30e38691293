"""Loading a model, describing its signature, and the fast predict function.

`load_model()` accepts a `.keras` or `.h5` file, a SavedModel folder, a TensorFlow
Serving base folder of numbered versions (the newest is served), or nothing: then the
built-in default model is built in-process from fixed seeds.

The predict path is a `tf.function` with a `None` batch dimension, traced once and then
called with batches padded to a few bucket sizes, each warmed before the worker is
ready. Keras 3's `model.predict` builds a data pipeline on every call (tens of ms on a
CPU, whatever the batch); it is kept only as the naive baseline (PREDICT_METHOD).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_FEATURES = 4
DEFAULT_OUTPUTS = 3
DEFAULT_WIDTH = 4096
DEFAULT_DEPTH = 4
DEFAULT_SEED = 1234

STRING = np.dtype(object)  # TensorFlow string tensors travel as numpy object arrays of bytes


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One named input or output: per-row shape (None where any size goes) and dtype."""

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype
    tf_dtype: str

    def accepts_row_shape(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape)
        )


@dataclasses.dataclass
class LoadedModel:
    name: str
    version: int
    source: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    predict: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
    load_s: float = 0.0
    warmup_s: float = 0.0
    keras_model: Any = None

    def input(self, name: str) -> TensorInfo:
        return next(spec for spec in self.inputs if spec.name == name)


class ModelLoadError(RuntimeError):
    pass


def build_default_model(
    *,
    features: int = DEFAULT_FEATURES,
    width: int = DEFAULT_WIDTH,
    depth: int = DEFAULT_DEPTH,
    outputs: int = DEFAULT_OUTPUTS,
    seed: int = DEFAULT_SEED,
) -> Any:
    """A wide dense network (4 x 4096 x 4096 float32, about 268 MB of weights).

    At one row per call the weights are read once per row, so a call is memory-bound and
    a batch of 32 costs little more than a batch of 1: batching pays even on a CPU.
    """
    import keras

    inputs = keras.Input((features,), name="features")
    hidden = keras.layers.Dense(width, activation="relu", name="expand",
                                kernel_initializer=keras.initializers.GlorotUniform(seed=seed))(inputs)
    for index in range(depth):
        hidden = keras.layers.Dense(
            width, activation="relu", name=f"hidden_{index}",
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1 + index),
        )(hidden)
    scores = keras.layers.Dense(outputs, name="scores",
                                kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1 + depth))(hidden)
    return keras.Model(inputs, scores, name="default")


def load_model(path: str | None, *, name: str, method: str = "function") -> LoadedModel:
    started = time.perf_counter()
    version = 1
    if path is None:
        source = "built-in default model"
        model = _from_keras(build_default_model(), name=name, version=version, source=source, method=method)
    else:
        resolved, version = resolve_version(path)
        source = resolved
        if os.path.isdir(resolved):
            model = _from_saved_model(resolved, name=name, version=version)
        elif resolved.endswith((".keras", ".h5", ".hdf5")):
            import keras

            try:
                keras_model = keras.models.load_model(resolved, compile=False)
            except Exception as exc:
                raise ModelLoadError(f"cannot load {resolved}: {type(exc).__name__}: {exc}") from exc
            model = _from_keras(keras_model, name=name, version=version, source=source, method=method)
        else:
            raise ModelLoadError(
                f"MODEL_PATH={path!r}: expected a .keras or .h5 file, a SavedModel folder or a folder of versions"
            )
    model.load_s = time.perf_counter() - started
    return model


def resolve_version(path: str) -> tuple[str, int]:
    """A TensorFlow Serving base path (numbered sub-folders) resolves to its newest version."""
    if not os.path.exists(path):
        raise ModelLoadError(f"MODEL_PATH={path!r} does not exist")
    versions = available_versions(path)
    if versions:
        newest = max(versions)
        return os.path.join(path, str(newest)), newest
    return path, 1


def available_versions(path: str) -> list[int]:
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "saved_model.pb")):
        return []
    return [int(entry) for entry in os.listdir(path) if entry.isdigit() and os.path.isdir(os.path.join(path, entry))]


def _dtype_info(dtype: Any) -> tuple[np.dtype, str]:
    import tensorflow as tf
    from tensorflow.core.framework import types_pb2

    tf_dtype = tf.as_dtype(dtype)
    enum_name = types_pb2.DataType.Name(tf_dtype.as_datatype_enum)  # DT_FLOAT, as TF Serving names it
    if tf_dtype == tf.string:
        return STRING, enum_name
    return np.dtype(tf_dtype.as_numpy_dtype), enum_name


def _info(name: str, shape: Sequence[int | None], dtype: Any) -> TensorInfo:
    np_dtype, tf_name = _dtype_info(dtype)
    return TensorInfo(name=name, shape=tuple(shape[1:]), dtype=np_dtype, tf_dtype=tf_name)


def _from_keras(keras_model: Any, *, name: str, version: int, source: str, method: str) -> LoadedModel:
    import tensorflow as tf

    inputs = [_info(t.name, t.shape, t.dtype) for t in keras_model.inputs]
    single_input = len(inputs) == 1
    declared_outputs = list(getattr(keras_model, "output_names", None) or [])

    def call(tensors: dict[str, Any]) -> Any:
        return keras_model(tensors[inputs[0].name] if single_input else tensors, training=False)

    def name_outputs(result: Any) -> dict[str, Any]:
        if isinstance(result, Mapping):
            return dict(result)
        if isinstance(result, (list, tuple)):
            names = declared_outputs if len(declared_outputs) == len(result) else [f"output_{i}" for i in range(len(result))]
            return dict(zip(names, result))
        return {declared_outputs[0] if len(declared_outputs) == 1 else "output_0": result}

    signature = [tf.TensorSpec((None, *spec.shape), tf.as_dtype(spec.dtype if spec.dtype != STRING else tf.string),
                               name=spec.name) for spec in inputs]

    @tf.function(input_signature=[signature])
    def serve(tensors: list[Any]) -> dict[str, Any]:
        return name_outputs(call({spec.name: tensor for spec, tensor in zip(inputs, tensors)}))

    concrete = serve.get_concrete_function()
    outputs = [_info(key, tensor.shape, tensor.dtype) for key, tensor in concrete.structured_outputs.items()]

    if method == "keras_predict":
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = keras_model.predict(batch[inputs[0].name] if single_input else batch, verbose=0)
            return {key: np.asarray(value) for key, value in name_outputs(result).items()}
    else:
        # The concrete function, traced once for a None batch dimension: calling it skips
        # tf.function's per-call signature matching (about 0.1 ms a call on a CPU).
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = concrete([batch[spec.name] for spec in inputs])
            return {key: value.numpy() for key, value in result.items()}

    return LoadedModel(name=name, version=version, source=source, inputs=inputs, outputs=outputs,
                       predict=predict, keras_model=keras_model)


def _from_saved_model(path: str, *, name: str, version: int) -> LoadedModel:
    import tensorflow as tf

    try:
        loaded = tf.saved_model.load(path)
        signature = loaded.signatures["serving_default"]
    except Exception as exc:
        raise ModelLoadError(f"cannot load the SavedModel in {path}: {type(exc).__name__}: {exc}") from exc
    input_specs = signature.structured_input_signature[1]
    inputs = [_info(key, spec.shape, spec.dtype) for key, spec in sorted(input_specs.items())]
    outputs = [_info(key, spec.shape, spec.dtype) for key, spec in sorted(signature.structured_outputs.items())]

    def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Keep a reference to `loaded`: the signature's variables live as long as it does.
        result = loaded.signatures["serving_default"](**{key: tf.constant(value) for key, value in batch.items()})
        return {key: value.numpy() for key, value in result.items()}

    return LoadedModel(name=name, version=version, source=path, inputs=inputs, outputs=outputs, predict=predict)


def example_batch(model: LoadedModel, rows: int) -> dict[str, np.ndarray]:
    """A batch of the right shapes and dtypes, for warm-up: dynamic dimensions get size 1."""
    batch = {}
    for spec in model.inputs:
        shape = (rows, *(1 if dim is None else dim for dim in spec.shape))
        batch[spec.name] = np.full(shape, b"", dtype=object) if spec.dtype == STRING else np.zeros(shape, spec.dtype)
    return batch


def warm_up(model: LoadedModel, buckets: Sequence[int]) -> float:
    """Run every bucket size once so no request pays for a first call of its shape."""
    started = time.perf_counter()
    for rows in buckets:
        model.predict(example_batch(model, rows))
    model.warmup_s = time.perf_counter() - started
    log.info("model '%s' warmed for batch sizes %s in %.2f s", model.name, list(buckets), model.warmup_s)
    return model.warmup_s
