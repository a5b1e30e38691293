"""Keras 3 on JAX: a `.keras` (or `.h5`) model served through `jax.jit` over `stateless_call`.

With KERAS_BACKEND=jax (Keras's own variable, read when `keras` is first imported) Keras's
layers are JAX code, and the TensorFlow path of app/core/models.py (a `tf.function` around the
model) cannot trace them. Here the model's variables are passed to one jitted function as
arguments, not closed over, so the weights stay device buffers rather than constants folded
into each program. `jax.jit` compiles once per input shape: the batcher pads every batch to
a bucket size and warm-up runs each bucket once, so there is one compiled program per bucket
(and per length bucket with PAD_VARIABLE_LENGTH), all built before the version serves.

Nothing here imports TensorFlow: on a host with JAX's CUDA build and no TensorFlow, a `.keras`
model is served by REST and v2 (gRPC's TF Serving API needs TensorFlow's protocol buffers).
SavedModels always load through TensorFlow (app/core/models.py).

A model JAX cannot run (string tensors; a layer written in TensorFlow) stops its load with a
ModelLoadError that names the model and the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from app.core.model_types import LoadedModel, ModelLoadError, TensorInfo

log = logging.getLogger(__name__)

# TensorFlow's DataType names (what metadata and gRPC show) for the dtypes JAX computes in.
_DATA_TYPES = {
    "float16": "DT_HALF", "bfloat16": "DT_BFLOAT16", "float32": "DT_FLOAT", "float64": "DT_DOUBLE",
    "int8": "DT_INT8", "int16": "DT_INT16", "int32": "DT_INT32", "int64": "DT_INT64",
    "uint8": "DT_UINT8", "uint16": "DT_UINT16", "uint32": "DT_UINT32", "uint64": "DT_UINT64",
    "bool": "DT_BOOL", "complex64": "DT_COMPLEX64", "complex128": "DT_COMPLEX128",
}

# What JAX holds a 64-bit input in unless jax_enable_x64 is on (JAX's own JAX_ENABLE_X64=1).
_NARROWED = {"int64": "int32", "uint64": "uint32", "float64": "float32", "complex128": "complex64"}


def _info(name: str, shape: Any, dtype: Any, *, model: str, narrow: bool = False) -> TensorInfo:
    import jax.numpy as jnp

    dtype_name = str(dtype)
    if dtype_name not in _DATA_TYPES:
        raise ModelLoadError(f"model '{model}': tensor '{name}' is {dtype_name}, which the JAX backend cannot "
                             "hold (JAX has no string tensors); serve this model without KERAS_BACKEND=jax")
    dims = tuple(None if dim is None else int(dim) for dim in shape)
    narrowed = np.dtype(_NARROWED[dtype_name]) if narrow and dtype_name in _NARROWED else None
    return TensorInfo(name=name, shape=dims[1:], dtype=np.dtype(jnp.dtype(dtype_name)),
                      tf_dtype=_DATA_TYPES[dtype_name], dims=dims, narrowed_to=narrowed)


def from_keras(keras_model: Any, *, name: str, version: int, source: str, method: str,
               name_outputs: Callable[[Any], dict[str, Any]]) -> LoadedModel:
    """Serve `keras_model` (loaded on the JAX backend); `name_outputs` names its outputs as
    the TensorFlow path does, so both backends describe a model alike."""
    import jax
    import keras

    # Without x64, jax.jit would narrow a 64-bit input silently (2**31 + 5 became -2**31 + 5): the
    # request layer refuses a value 32 bits cannot hold instead (app/core/serving.py). With it, exact.
    narrow = not jax.config.jax_enable_x64
    inputs = [_info(t.name, t.shape, t.dtype, model=name, narrow=narrow) for t in keras_model.inputs]
    single_input = len(inputs) == 1

    def arrange(tensors: dict[str, Any]) -> Any:
        return tensors[inputs[0].name] if single_input else tensors

    symbolic = {spec.name: keras.KerasTensor(spec.dims, dtype=spec.dtype.name, name=spec.name)
                for spec in inputs}
    try:
        described = name_outputs(keras_model.compute_output_spec(arrange(symbolic), training=False))
    except Exception as exc:
        raise ModelLoadError(f"model '{name}' ({source}) cannot run on the JAX backend: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc
    outputs = [_info(key, tensor.shape, tensor.dtype, model=name) for key, tensor in described.items()]

    trainable = [variable.value for variable in keras_model.trainable_variables]
    non_trainable = [variable.value for variable in keras_model.non_trainable_variables]
    traces = 0

    def forward(trainable: list[Any], non_trainable: list[Any], tensors: dict[str, Any]) -> dict[str, Any]:
        nonlocal traces
        traces += 1  # runs while jax traces a new input shape, never on a compiled call
        result, _ = keras_model.stateless_call(trainable, non_trainable, arrange(tensors), training=False)
        return name_outputs(result)

    compiled = jax.jit(forward)

    if method == "keras_predict":
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = keras_model.predict(arrange(batch), verbose=0)
            return {key: np.asarray(value) for key, value in name_outputs(result).items()}
    else:
        def predict(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = compiled(trainable, non_trainable, {spec.name: batch[spec.name] for spec in inputs})
            # One transfer of every output to the host, which the answer is encoded from.
            return {key: np.asarray(value) for key, value in jax.device_get(result).items()}

    log.info("model '%s' v%d runs on Keras's JAX backend (jax %s, %s)", name, version, jax.__version__,
             ", ".join(sorted({device.platform for device in jax.devices()})))
    return LoadedModel(name=name, version=version, source=source, inputs=inputs, outputs=outputs, predict=predict,
                       keras_model=keras_model, tracing_count=lambda: traces)
