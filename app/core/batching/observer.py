"""What the engine reports (to metrics), and the guard that keeps a failing report harmless."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from app.ops.observer import BatchObserver

log = logging.getLogger(__name__)


class GuardedObserver(BatchObserver):
    """Calls an observer's hooks; one that raises is logged, once per hook, and ignored.

    Metrics must never cost a request its answer, nor the batch thread its life.
    """

    def __init__(self, observer: BatchObserver, name: str) -> None:
        self._observer = observer
        self._name = name
        self._failed: set[str] = set()
        self.traces = observer.traces

    # Each hook calls its own: these run on every request's path, where a generic
    # getattr-and-forward layer costs more than the hook itself.
    def queue_depth(self, rows: int) -> None:
        try:
            self._observer.queue_depth(rows)
        except Exception:
            self._log_once("observer hook queue_depth")

    def queue_wait(self, seconds: float) -> None:
        try:
            self._observer.queue_wait(seconds)
        except Exception:
            self._log_once("observer hook queue_wait")

    def level_depth(self, level: int, rows: int) -> None:
        try:
            self._observer.level_depth(level, rows)
        except Exception:
            self._log_once("observer hook level_depth")

    def level_rejected(self, level: int) -> None:
        try:
            self._observer.level_rejected(level)
        except Exception:
            self._log_once("observer hook level_rejected")

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        try:
            self._observer.batch_done(rows=rows, requests=requests, padded_rows=padded_rows, predict_s=predict_s)
        except Exception:
            self._log_once("observer hook batch_done")

    def call_answered(self, *, rows: int, requests: int, input_s: float, infer_s: float, output_s: float,
                      finished_s: list[float]) -> None:
        try:
            self._observer.call_answered(rows=rows, requests=requests, input_s=input_s, infer_s=infer_s,
                                         output_s=output_s, finished_s=finished_s)
        except Exception:
            self._log_once("observer hook call_answered")

    def requests_failed(self, waited_s: list[float]) -> None:
        try:
            self._observer.requests_failed(waited_s)
        except Exception:
            self._log_once("observer hook requests_failed")

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        try:
            self._observer.length_padding(real_elements=real_elements, padded_elements=padded_elements)
        except Exception:
            self._log_once("observer hook length_padding")

    def rejected(self, reason: str) -> None:
        try:
            self._observer.rejected(reason)
        except Exception:
            self._log_once("observer hook rejected")

    def predict_call(self, traces: list[Any], *, rows: int, padded_rows: int, predict_s: float,
                     error: BaseException | None) -> None:
        try:
            self._observer.predict_call(traces, rows=rows, padded_rows=padded_rows, predict_s=predict_s, error=error)
        except Exception:
            self._log_once("observer hook predict_call")

    def guarded(self, what: str, call: Callable[[], bool]) -> bool:
        """call(), or False where it raises (logged once): for the callers' own predicates."""
        try:
            return call()
        except Exception:
            self._log_once(what)
            return False

    def _log_once(self, what: str) -> None:
        if what not in self._failed:
            self._failed.add(what)
            log.exception("%s of model '%s' failed (logged once)", what, self._name)
