"""How the rows of several requests become one batch, and the batch's outputs rows again.

This module is the one place that decides which requests may share a batch (`batch_key`),
how their rows are joined and padded to a bucket (`join_rows`, `pad_rows`), and what the
model must give back (`check_outputs`). Variable-length padding replaces `batch_key` and
`join_rows` here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from app.errors import BadRequest, InvalidInput, PayloadTooLarge

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
    counts = {arr.shape[0] if arr.ndim else -1 for arr in inputs.values()}
    if len(counts) != 1 or -1 in counts:
        raise InvalidInput(f"all inputs must have the same number of rows; got {sorted(counts)}")
    return counts.pop()


def request_rows(inputs: Tensors, *, max_rows: int, name: str) -> int:
    """The request's row count, once it is known to be one the model may take."""
    rows = row_count(inputs)
    if rows == 0:
        raise InvalidInput("the request holds no rows")
    if rows > max_rows:
        raise PayloadTooLarge(
            f"the request holds {rows} rows; model '{name}' takes at most {max_rows} rows per request "
            "(MAX_REQUEST_ROWS)"
        )
    return rows


def batch_key(inputs: Tensors) -> Hashable:
    """Requests share a batch only if their keys are equal: every input has the same per-row
    shape and dtype."""
    return tuple(sorted((name, arr.shape[1:], arr.dtype.str) for name, arr in inputs.items()))


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
