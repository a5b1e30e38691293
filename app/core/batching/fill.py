"""The fill policy: whether a batch that is not full goes now or waits for more rows.

Pure: it is told the clock's reading and the statistics of each predict call, and answers
with a decision; it starts no thread and reads no queue. The rule is written out once, in
docs/batching.md ("When a batch goes").
"""

from __future__ import annotations

import dataclasses

# A batch waits to fill when the last predict call answered at least this share of a full
# batch (and they are coming back), or when requests waited through it and, with those it
# answered, made that share: clients that many, just answered, are likely to come straight
# back. Fewer is moderate load, where waiting for clients that think between requests would
# only add latency.
FILL_UNDER_LOAD_SHARE = 4  # a quarter of max_batch_size
FILL_UNDER_LOAD_MIN_REQUESTS = 3
# A closed loop's first client is back once the answers ahead of its own are written: 18 ms
# after a 32-request call at the median, 29 ms at most (the wide model, 2 cores), about 0.6 ms
# an answer. With four times that per request answered, on top of the call's own time, such a
# loop is still told from a burst followed by quiet (users who think for a second).
FILL_RETURN_S_PER_REQUEST = 0.002


@dataclasses.dataclass(frozen=True)
class CallStats:
    """One predict call that answered, as the fill policy learns from it."""

    requests: int  # requests it answered
    predict_s: float
    ended_at: float  # the clock's reading when it returned
    waiting: int  # requests queued when it returned: they waited through it


@dataclasses.dataclass(frozen=True)
class FillWait:
    """Wait for more rows until the clock reads `until`; go sooner once the batch is full or
    holds `requests` requests."""

    until: float
    requests: int


class FillPolicy:
    """Decides each batch's wait from the knobs and the last predict call that answered."""

    def __init__(self, *, max_batch_size: int, batch_timeout_s: float = 0.0, fill_under_load: bool = True) -> None:
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_s
        self.fill_under_load = fill_under_load
        self.last_call = CallStats(requests=0, predict_s=0.0, ended_at=0.0, waiting=0)

    def record(self, stats: CallStats) -> None:
        self.last_call = stats

    def decide(self, *, oldest_enqueued_at: float, now: float) -> FillWait | None:
        """The wait of a batch that is not full and whose oldest request came at
        `oldest_enqueued_at`; None: it goes now."""
        if self.batch_timeout_s > 0:
            # Wait for more until the oldest has waited its window; past it, still take what is
            # already queued: under load the oldest has often waited its window out behind the last batch.
            return FillWait(until=oldest_enqueued_at + self.batch_timeout_s, requests=self.max_batch_size)
        if not self.fill_under_load:
            return None
        last = self.last_call
        if self.loop_returning(oldest_enqueued_at):
            # The clients of a closed loop: those just answered come straight back, and no
            # more. Waiting for a full batch past them would idle the model a whole window.
            return FillWait(until=now + last.predict_s, requests=last.requests + last.waiting)
        if self.load_rising():
            return FillWait(until=now + last.predict_s, requests=self.max_batch_size)
        return None

    @property
    def fill_wanted(self) -> int:
        return max(FILL_UNDER_LOAD_MIN_REQUESTS, self.max_batch_size // FILL_UNDER_LOAD_SHARE)

    def loop_returning(self, oldest_enqueued_at: float) -> bool:
        """The last call answered a quarter of a batch, and this batch's oldest request came soon
        after it: the clients of a closed loop, not a burst that has ended."""
        last = self.last_call
        came_after_s = oldest_enqueued_at - last.ended_at
        soon_s = last.predict_s + last.requests * FILL_RETURN_S_PER_REQUEST
        return last.requests >= self.fill_wanted and came_after_s <= soon_s

    def load_rising(self) -> bool:
        """Requests waited through the last call and, with those it answered, made a quarter of a batch."""
        last = self.last_call
        return last.waiting >= 1 and last.requests + last.waiting >= self.fill_wanted
