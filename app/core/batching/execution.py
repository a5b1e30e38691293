"""Execution: one batch through the model, and each request's rows back to it.

The batch is padded up to the next bucket size, so the model only ever sees shapes it was
warmed with, and each request gets its own rows back through its future. A failed call is
retried in halves, so that a poisoned request fails alone, within a budget of calls. What
the fill policy needs to know of the calls is returned, not written anywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from app.core.batching.fill import CallStats
from app.core.batching.observer import BatchObserver
from app.core.batching.rows import LengthCut, Padding, check_outputs, join_padded, join_rows, pad_rows, padding_waste
from app.core.batching.work import Slice, drop_if_abandoned, settle
from app.core.errors import PredictFailed, ServingError

log = logging.getLogger(__name__)

PredictFn = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]


def max_predict_calls(requests: int) -> int:
    """Predict calls a failing batch may make while bisecting: enough to isolate two poisoned
    requests, far fewer than the 2n - 1 that would prove each of n failing requests alone."""
    return 1 + 4 * (requests - 1).bit_length()


class Executor:
    """Runs batches through one predict function; only the batch thread calls it."""

    def __init__(self, predict_fn: PredictFn, *, name: str, buckets: Sequence[int], bisect_failures: bool,
                 observer: BatchObserver, clock: Callable[[], float], waiting: Callable[[], int],
                 padding: Padding | None = None, whole: bool = False) -> None:
        self.name = name
        self.padding = padding
        self.whole = whole
        self.buckets = tuple(buckets)
        self.bisect_failures = bisect_failures
        self.whole = whole
        self._predict_fn = predict_fn
        self._observer = observer
        # Read once: without a tracer, nothing per call gathers the requests' traces.
        self._traces = observer.traces
        self._clock = clock
        # Requests queued behind the batch, read as each call returns: they waited through it.
        self._waiting = waiting

    def run(self, slices: list[Slice]) -> CallStats | None:
        """Predict; on failure retry halves (depth first) so that a poisoned request fails alone,
        within a budget of calls, and never for requests whose deadline has passed. Returns the
        statistics of the last call that answered, if any did."""
        calls_left = max_predict_calls(len(slices)) if self.bisect_failures else 1
        parts: list[tuple[list[Slice], ServingError | None]] = [(slices, None)]
        stats = None
        while parts:
            part, earlier_error = parts.pop()
            if earlier_error is not None:
                part = [piece for piece in part if not drop_if_abandoned(piece.pending, self._clock(), self._observer)]
                if not part:
                    continue
                if calls_left == 0:
                    self.fail(part, earlier_error)
                    continue
            calls_left -= 1
            began = self._clock()
            try:
                outputs, rows, padded, predict_s, cut = self._predict(part)
                returned = self._clock()
                stats = CallStats(requests=len(part), predict_s=predict_s, ended_at=returned,
                                  waiting=self._waiting())
            except Exception as exc:
                error = exc if isinstance(exc, ServingError) else PredictFailed.from_exception(exc)
                if len(part) > 1 and calls_left > 0:
                    middle = len(part) // 2
                    parts += [(part[middle:], error), (part[:middle], error)]
                else:
                    self.fail(part, error)
                continue
            self._observer.batch_done(rows=rows, requests=len(part), padded_rows=padded - rows, predict_s=predict_s)
            sliced = self._clock()
            if self.whole:
                part[0].pending.deliver(outputs, rows, 1, done=True)
            else:
                _slice_back(part, outputs, rows, cut)
            now = self._clock()
            # The v2 statistics: what joining and padding, the call, and slicing back took.
            self._observer.call_answered(rows=rows, requests=len(part), input_s=returned - began - predict_s,
                                         infer_s=predict_s, output_s=now - sliced,
                                         finished_s=[now - piece.pending.enqueued_at for piece in part if piece.last])
        return stats

    def fail(self, part: list[Slice], error: ServingError) -> None:
        log.warning("predict of model '%s' failed for %d request(s): %s", self.name, len(part), error)
        now = self._clock()
        self._observer.requests_failed([now - piece.pending.enqueued_at for piece in part
                                        if settle(piece.pending, exception=error)])

    def _predict(self, part: list[Slice]) -> tuple[dict[str, np.ndarray], int, int, float, LengthCut | None]:
        cut = None
        if self.whole:
            # An unbatchable signature's request, as its client sent it: nothing joined or padded.
            return self._call(part, dict(part[0].pending.inputs), 1, 1, cut)
        parts = [(piece.pending.inputs, piece.start, piece.stop) for piece in part]
        if self.padding is None:
            inputs = join_rows(parts)
        else:
            inputs, cut = join_padded(parts, self.padding)
            real, waste = padding_waste(parts, inputs)
            self._observer.length_padding(real_elements=real, padded_elements=waste)
        rows = sum(piece.rows for piece in part)
        padded = next(size for size in self.buckets if size >= rows)
        if padded > rows:
            inputs = pad_rows(inputs, padded)
        return self._call(part, inputs, rows, padded, cut)

    def _call(self, part: list[Slice], inputs: dict[str, np.ndarray], rows: int, padded: int,
              cut: LengthCut | None) -> tuple[dict[str, np.ndarray], int, int, float, LengthCut | None]:
        started = self._clock()
        try:
            answer = self._predict_fn(inputs)
            if self.whole:
                outputs = {name: np.asarray(value) for name, value in answer.items()}
            else:
                outputs = check_outputs(answer, padded)
        except Exception as exc:
            if self._traces:
                self._trace(part, rows, padded, self._clock() - started, exc)
            raise
        predict_s = self._clock() - started
        if self._traces:
            self._trace(part, rows, padded, predict_s, None)
        return outputs, rows, padded, predict_s, cut

    def _trace(self, part: list[Slice], rows: int, padded: int, predict_s: float, error: Exception | None) -> None:
        self._observer.predict_call([piece.pending.call.trace for piece in part], rows=rows, padded_rows=padded - rows,
                                    predict_s=predict_s, error=error)


def _slice_back(part: list[Slice], outputs: dict[str, np.ndarray], rows: int, cut: LengthCut | None) -> None:
    offset = 0
    for index, piece in enumerate(part):
        own = {name: out[offset : offset + piece.rows] for name, out in outputs.items()}
        if cut is not None:
            own = cut.cut(index, own)
        piece.pending.deliver(own, rows, len(part), done=piece.last)
        offset += piece.rows
