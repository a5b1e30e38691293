"""What a loaded model is, whichever backend runs it: its signatures, their tensors, the predict function.

app/core/models.py loads models on TensorFlow, app/core/jax_model.py on Keras's JAX backend; both build
these, and every layer above reads them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

STRING = np.dtype(object)  # TensorFlow string tensors travel as numpy object arrays of bytes
DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"


# TensorInfo.dims when a caller gives none: a batch of rows of `shape`.
_ROWS: Any = object()


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One named input or output: per-row shape (None where any size goes) and dtype.

    `dims` is the shape as the signature declares it, batch dimension included, and None
    where the rank is unknown (a TF1 placeholder without a shape); `tensor_name` is the
    graph's tensor (`x:0`), as TF Serving's metadata shows it, or "" where there is no graph
    tensor to name (a Keras model). A tensor of unknown rank takes rows of any shape.
    """

    name: str
    shape: tuple[int | None, ...]
    dtype: np.dtype
    tf_dtype: str
    tensor_name: str = ""
    dims: tuple[int | None, ...] | None = _ROWS
    # The narrower dtype the backend computes this input in, where it does (Keras on JAX holds
    # 64-bit inputs in 32 bits): a value it cannot hold exactly is refused, never changed.
    narrowed_to: np.dtype | None = None

    def __post_init__(self) -> None:
        if self.dims is _ROWS:
            object.__setattr__(self, "dims", (None, *self.shape))

    @property
    def unknown_rank(self) -> bool:
        return self.dims is None

    @property
    def batched(self) -> bool:
        """Whether the leading dimension is a batch of any size: the batcher may stack requests on it."""
        return self.dims is not None and len(self.dims) > 0 and self.dims[0] is None

    def accepts_row_shape(self, shape: Sequence[int]) -> bool:
        if self.dims is None:
            return True
        return len(shape) == len(self.shape) and all(
            want is None or want == got for want, got in zip(self.shape, shape, strict=True)
        )


PredictFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclasses.dataclass
class Signature:
    """One signature_def: what the codec reads and writes (.inputs/.outputs) and how to run it."""

    name: str
    method_name: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    predict: PredictFn

    @functools.cached_property
    def narrowed_inputs(self) -> tuple[TensorInfo, ...]:
        return tuple(spec for spec in self.inputs if spec.narrowed_to is not None)

    @property
    def batchable(self) -> bool:
        """Whether requests may be stacked into one call: every input and output has a leading
        batch dimension of any size. TF Serving serves the others as they are, one request a
        call; so will the engine."""
        return bool(self.inputs) and all(spec.batched for spec in [*self.inputs, *self.outputs])


@dataclasses.dataclass
class LoadedModel:
    name: str
    version: int
    source: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    predict: PredictFn
    load_s: float = 0.0
    warmup_s: float = 0.0
    keras_model: Any = None
    # How many times the predict path was traced (a Keras model's tf.function), for the tests
    # that show warm-up leaves nothing to trace under load; None where it is not known.
    tracing_count: Callable[[], int] | None = None
    signatures: dict[str, Signature] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.signatures:
            self.signatures = {DEFAULT_SIGNATURE: Signature(DEFAULT_SIGNATURE, PREDICT_METHOD, self.inputs,
                                                            self.outputs, self.predict)}

    @property
    def default_signature(self) -> str:
        """serving_default, or for a SavedModel without one, the signature inputs/outputs describe."""
        return next(key for key, signature in self.signatures.items() if signature.predict is self.predict)


class ModelLoadError(RuntimeError):
    pass
