"""How the rows of several requests become one batch, and the batch's outputs rows again.

This module is the one place that decides which requests may share a batch (`batch_key`),
how their rows are joined and padded to a bucket (`join_rows`, `pad_rows`), and what the
model must give back (`check_outputs`). With variable-length padding (a `Padding`), requests
whose rows differ only in the dimensions the signature declares `None` share a batch
(`join_padded`), and each request's outputs are cut back to its own lengths (`LengthCut`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from app.core.errors import BadRequest, InvalidInput, PayloadTooLarge

Tensors = Mapping[str, np.ndarray]


def bucket_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below max_batch_size, then max_batch_size itself."""
    sizes = []
    size = 1
    while size < max_batch_size:
        sizes.append(size)
        size *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def row_count(inputs: Tensors) -> int:
    if len(inputs) == 1:  # the common case, without a set
        for arr in inputs.values():
            if arr.ndim:
                return arr.shape[0]
    counts = {arr.shape[0] if arr.ndim else -1 for arr in inputs.values()}
    if len(counts) != 1 or -1 in counts:
        raise InvalidInput(f"all inputs must have the same number of rows; got {sorted(counts)}")
    return counts.pop()


def check_rows(rows: int, limit: int, *, unit: str = "rows") -> int:
    """`rows`, or PayloadTooLarge when it is over the model's MAX_REQUEST_ROWS: the one wording,
    whether a front door refuses them before it builds any array or the engine at submit."""
    if rows > limit:
        raise PayloadTooLarge(f"the request holds {rows} {unit}; this model takes at most {limit} "
                              "rows per request (MAX_REQUEST_ROWS)")
    return rows


def request_rows(inputs: Tensors, *, max_rows: int) -> int:
    """The request's row count, once it is known to be one the model may take."""
    rows = row_count(inputs)
    if rows == 0:
        raise InvalidInput("the request holds no rows")
    return check_rows(rows, max_rows)


def check_lengths(inputs: Tensors, padding: Padding) -> None:
    """400 for an input with no element along an axis that padding pads: in a batch, padding
    would invent every value the model sees of that row, and alone the model may fail on it;
    refused the same way whoever shares the queue."""
    for name, axes in padding.inputs.items():
        array = inputs.get(name)
        if array is None:
            continue
        for axis in axes:
            if axis + 1 < array.ndim and array.shape[axis + 1] == 0:
                raise InvalidInput(f"input '{name}' has shape {list(array.shape)}: its dimension {axis + 1} is "
                                   "variable-length and must hold at least one element")


@dataclasses.dataclass(frozen=True)
class Padding:
    """Which per-row dimensions of a signature may be padded, with what, and to which lengths.

    `inputs` maps an input to its variable axes (of the per-row shape, 0 first); `outputs`
    maps an output to the axes it declares `None`: those may follow an input's length. With
    `length_buckets`, a length is padded to the next bucket (past the largest: not at all),
    and only requests of the same buckets share a batch, so that one long request does not pad
    many short ones; without, the batch's longest sets the length and any lengths share.
    """

    inputs: Mapping[str, tuple[int, ...]]
    outputs: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    value: float = 0.0
    length_buckets: tuple[int, ...] = ()

    def padded_length(self, length: int) -> int:
        return next((bucket for bucket in self.length_buckets if bucket >= length), length)

    def group(self, length: int) -> int:
        """The part of a length that batch keys compare: its bucket, or nothing (-1) without buckets."""
        return self.padded_length(length) if self.length_buckets else -1


def batch_key(inputs: Tensors, padding: Padding | None = None) -> Hashable:
    """Requests share a batch only if their keys are equal: every input has the same per-row
    shape and dtype, up to the variable dimensions that `padding` pads."""
    if padding is None:
        # dtypes compare as their .str does (byte order included) and key in half the time.
        if len(inputs) == 1:  # the common case, without a sort
            return tuple([(name, arr.shape[1:], arr.dtype) for name, arr in inputs.items()])
        return tuple(sorted((name, arr.shape[1:], arr.dtype) for name, arr in inputs.items()))
    key = []
    for name, arr in sorted(inputs.items()):
        shape = list(arr.shape[1:])
        for axis in padding.inputs.get(name, ()):
            if axis < len(shape):
                shape[axis] = padding.group(shape[axis])
        key.append((name, tuple(shape), arr.ndim, arr.dtype.str))
    return tuple(key)


def padding_waste(parts: Sequence[tuple[Tensors, int, int]], padded: Tensors) -> tuple[int, int]:
    """(real elements, padding elements) of a padded call's inputs, over the real rows only:
    rows added to reach a batch bucket are counted apart (`padded_rows`)."""
    real = sum(math.prod(arr.shape[1:]) * (stop - start) for inputs, start, stop in parts for arr in inputs.values())
    rows = sum(stop - start for _inputs, start, stop in parts)
    held = sum(rows * math.prod(arr.shape[1:]) for arr in padded.values())
    return real, held - real


@dataclasses.dataclass(frozen=True)
class LengthCut:
    """Each part's own lengths, and the lengths of the call: what to cut off each part's outputs."""

    own: list[dict[tuple[str, int], int]]
    padded: dict[tuple[str, int], int]
    padding: Padding

    def cut(self, index: int, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Part `index`'s output rows, each output axis that follows an input's padded length cut
        back to the part's own length. An output axis follows an input's length when the signature
        declares it `None` and the call gave it exactly that input's padded length; where several
        inputs were padded to the same length, they are one length (the first is taken)."""
        own = self.own[index]
        result = {}
        for name, arr in outputs.items():
            for axis in self.padding.outputs.get(name, ()):
                size = arr.shape[axis + 1] if axis + 1 < arr.ndim else None
                source = next((where for where, padded in self.padded.items() if padded == size), None)
                if source is not None and own[source] != size:
                    arr = arr[(slice(None),) * (axis + 1) + (slice(0, own[source]),)]
            result[name] = arr
        return result


def join_padded(parts: Sequence[tuple[Tensors, int, int]], padding: Padding) -> tuple[dict[str, np.ndarray], LengthCut]:
    """Rows start:stop of each request's inputs as one batch, each variable axis padded with
    `padding.value` to the batch's longest (or that length's bucket)."""
    own: list[dict[tuple[str, int], int]] = []
    for inputs, _start, _stop in parts:
        own.append({(name, axis): inputs[name].shape[axis + 1] for name, axes in padding.inputs.items()
                    if name in inputs for axis in axes if axis + 1 < inputs[name].ndim})
    padded = {where: padding.padded_length(max(lengths[where] for lengths in own)) for where in own[0]}
    joined = {}
    for name in parts[0][0]:
        pieces = []
        for (inputs, start, stop), lengths in zip(parts, own, strict=True):
            arr = inputs[name][start:stop]
            widths = [(0, 0)] * arr.ndim
            for (input_name, axis), length in lengths.items():
                if input_name == name:
                    widths[axis + 1] = (0, padded[(name, axis)] - length)
            if any(after for _before, after in widths):
                arr = np.pad(arr, widths, constant_values=_pad_value(arr.dtype, padding.value))
            pieces.append(arr)
        joined[name] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    return joined, LengthCut(own, padded, padding)


def _pad_value(dtype: np.dtype, value: float) -> Any:
    # String tensors travel as object arrays of bytes: they pad with the empty string.
    if dtype.kind == "O":
        return b""
    return np.array(value).astype(dtype)


def join_rows(parts: Sequence[tuple[Tensors, int, int]]) -> dict[str, np.ndarray]:
    """Rows start:stop of each request's inputs, in order, as one batch."""
    inputs, start, stop = parts[0]
    if len(parts) == 1 and start == 0 and stop == len(next(iter(inputs.values()))):
        return dict(inputs)
    return {name: np.concatenate([part[name][start:stop] for part, start, stop in parts]) for name in inputs}


def pad_rows(inputs: Tensors, rows: int) -> dict[str, np.ndarray]:
    """The batch grown to `rows` rows, so the model sees only the sizes it was warmed with."""
    # Repeat the last row rather than add zeros: valid for any dtype, strings included.
    return {name: np.concatenate([arr, np.repeat(arr[-1:], rows - arr.shape[0], axis=0)])
            for name, arr in inputs.items()}


def check_outputs(outputs: Mapping[str, Any], rows: int) -> dict[str, np.ndarray]:
    checked = {}
    for name, value in outputs.items():
        arr = np.asarray(value)
        if arr.ndim == 0 or arr.shape[0] != rows:
            # A 400, as TF Serving answers outputs of different batch sizes (util/json_tensor.cc).
            raise BadRequest(
                f"output '{name}' has shape {arr.shape} for a batch of {rows} rows; "
                "every output must have one row per input row"
            )
        checked[name] = arr
    return checked
