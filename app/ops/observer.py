"""What the batching engine reports: the hooks the metrics, the statistics and the tracer listen on.

The engine (app/core/batching/) calls a `BatchObserver`'s hooks and guards them, so that a hook
that raises is logged and ignored (app/core/batching/observer.py's GuardedObserver).
"""

from __future__ import annotations

from typing import Any


class BatchObserver:
    """Hooks the engine calls; the default does nothing. A hook that raises is logged and ignored.

    `queue_depth` is called with the row queue's mutex held, so successive calls report the
    queued rows in the order they changed: a gauge set from it never ends on a stale value.
    `rejected` hears of every request refused or dropped, with its reason: `queue_full`,
    `shutting_down`, `deadline`, `client_gone`.

    `predict_call` is called only where `traces` is true (a tracer): after every predict call,
    answered or failed, with the `trace` each of its requests was submitted with. Left false,
    the engine does not even gather them.
    """

    traces = False

    def queue_depth(self, rows: int) -> None:
        pass

    def queue_wait(self, seconds: float) -> None:
        pass

    def level_depth(self, level: int, rows: int) -> None:
        """With priority levels only: the rows queued at one level (1 is the highest), as they change."""

    def level_rejected(self, level: int) -> None:
        """With a level's own queue limit: a request refused because its level was full."""

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        pass

    def call_answered(self, *, rows: int, requests: int, input_s: float, infer_s: float, output_s: float,
                      finished_s: list[float]) -> None:
        """After each predict call that answered: seconds to join and pad its inputs, of the call,
        and to slice its outputs back; `finished_s`, for each request it finished, seconds since queued."""

    def requests_failed(self, waited_s: list[float]) -> None:
        """Requests failed because the predict call raised (each once), with the seconds since each was queued."""

    def length_padding(self, *, real_elements: int, padded_elements: int) -> None:
        """Once per call with variable-length padding: input elements sent, and those added to pad them."""

    def rejected(self, reason: str) -> None:
        pass

    def predict_call(self, traces: list[Any], *, rows: int, padded_rows: int, predict_s: float,
                     error: BaseException | None) -> None:
        pass
