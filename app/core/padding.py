"""Variable-length padding for a model's signatures: which axes, and the check that it is safe.

The engine (`app/core/batching/rows.py`) pads and cuts; this module decides, per signature, what
it may pad: the per-row dimensions the signature declares `None`. Before a signature is served
padded, `check_padding` runs it on made-up rows of two lengths, alone and padded together,
and refuses padding where the short row's answer changes: a model that does not mask its
padding would otherwise answer differently depending on who shared its batch.
"""

from __future__ import annotations

import logging

import numpy as np

from app.core.batching.rows import Padding, join_padded
from app.core.models import STRING, LoadedModel, Signature
from app.ops.settings import ModelConfig

log = logging.getLogger(__name__)

# The check's rows: short enough to be padded by any bucket, and padded to at least this.
CHECK_SHORT = 3
CHECK_LONG = 16
# Float outputs of a padded row may differ from the unpadded ones in the last bits only:
# reductions over a longer (masked) axis add the same terms in another order.
CHECK_RTOL = 1e-4
CHECK_ATOL = 1e-5


def signature_padding(signature: Signature, config: ModelConfig) -> Padding | None:
    """The padding of a signature, or None where it is off or nothing in the signature varies."""
    # A signature served one request a call (no batch dimension) has nothing to pad, and the
    # check must not run it: it may keep state (TF Serving's counter model).
    if not config.pad_variable_length or not getattr(signature, "batchable", True):
        return None
    inputs = {spec.name: axes for spec in signature.inputs
              if (axes := tuple(axis for axis, dim in enumerate(spec.shape) if dim is None))}
    if not inputs:
        return None
    outputs = {spec.name: axes for spec in signature.outputs
               if (axes := tuple(axis for axis, dim in enumerate(spec.shape) if dim is None))}
    return Padding(inputs=inputs, outputs=outputs, value=config.pad_value, length_buckets=config.length_buckets)


def model_paddings(model: LoadedModel, config: ModelConfig) -> dict[str, Padding | None]:
    """Each signature's padding, once the check has passed; refused ones are logged and served unpadded."""
    paddings: dict[str, Padding | None] = {}
    for key, signature in model.signatures.items():
        padding = signature_padding(signature, config)
        if padding is not None:
            refusal = check_padding(signature, padding)
            if refusal is not None:
                log.error("model '%s' v%d, signature '%s': variable-length padding refused, requests of different "
                          "lengths will not share a call: %s", model.name, model.version, key, refusal)
                padding = None
        paddings[key] = padding
    return paddings


def check_rows(signature: Signature, length: int, value: float, seed: int) -> dict[str, np.ndarray]:
    """One row per input, its variable dimensions `length` long, holding no pad value."""
    rng = np.random.default_rng(seed)
    # Small positive ids are in any vocabulary; the pad value is left out so nothing is masked.
    ids = [candidate for candidate in (1, 2, 3) if candidate != value][:2]
    rows = {}
    for spec in signature.inputs:
        shape = (1, *(length if dim is None else dim for dim in spec.shape))
        if spec.dtype == STRING:
            rows[spec.name] = np.full(shape, b"a", dtype=object)
        elif spec.dtype == np.bool_:
            rows[spec.name] = np.ones(shape, dtype=bool)
        elif np.issubdtype(spec.dtype, np.integer):
            rows[spec.name] = rng.choice(ids, shape).astype(spec.dtype)
        else:
            rows[spec.name] = rng.uniform(0.5, 1.5, shape).astype(spec.dtype)
    return rows


def check_padding(signature: Signature, padding: Padding) -> str | None:
    """None where a short row padded in a batch with a long one gets its own answer; else why not."""
    long = max(CHECK_LONG, *padding.length_buckets) if padding.length_buckets else CHECK_LONG
    short_rows = check_rows(signature, CHECK_SHORT, padding.value, seed=0)
    long_rows = check_rows(signature, long, padding.value, seed=1)
    try:
        alone = {name: np.asarray(value) for name, value in signature.predict(short_rows).items()}
        inputs, cut = join_padded([(short_rows, 0, 1), (long_rows, 0, 1)], padding)
        together = cut.cut(0, {name: np.asarray(value)[:1] for name, value in signature.predict(inputs).items()})
    except Exception as exc:
        return f"the check's predict call failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    for name, want in alone.items():
        got = together.get(name)
        if got is None or got.shape != want.shape:
            return (f"output '{name}' has shape {None if got is None else got.shape} for a row padded from "
                    f"{CHECK_SHORT} to {long}, and {want.shape} unpadded")
        if want.dtype == object or not np.issubdtype(want.dtype, np.inexact):
            same = np.array_equal(got, want)
        else:
            same = np.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL)
        if not same:
            worst = "" if not np.issubdtype(want.dtype, np.number) else \
                f" by up to {float(np.max(np.abs(got.astype(float) - want.astype(float)))):.3g}"
            return (f"output '{name}' differs{worst} for a row padded from {CHECK_SHORT} to {long} with "
                    f"{padding.value:g}: the model does not mask its padding (docs/batching.md, "
                    "'Variable-length inputs')")
    return None


def warm_lengths(config: ModelConfig) -> tuple[int, ...]:
    """The lengths warmed besides 1: the length buckets, where padding is on."""
    return config.length_buckets if config.pad_variable_length else ()
