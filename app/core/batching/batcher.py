"""The batcher: the one thread that runs a model's batches, and its life from start to close.

Request threads call `submit(call, inputs)` (or `predict()`), which puts a work item, holding
the call, in the row queue.
The batch thread takes the backlog from the queue, forms a batch of compatible requests,
asks the fill policy whether to wait for more rows, and hands the batch to the executor;
the executor's call statistics go back to the fill policy.

What no caller may ever see is a future that nobody will finish. So the one `try` in `_run`
covers the whole loop: whatever kills the thread, every request the queue holds is failed
at once and `on_broken` is called.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable

from app.core.batching.engine import EngineInfo, wait
from app.core.batching.execution import Executor, PredictFn
from app.core.batching.fill import FillPolicy
from app.core.batching.observer import BatchObserver, GuardedObserver
from app.core.batching.row_queue import RowQueue
from app.core.batching.rows import Padding, Tensors, bucket_sizes, check_lengths, request_rows
from app.core.batching.work import Batch, BatchResult, Pending, drop_if_abandoned, settle, start
from app.core.call import Call
from app.core.errors import BatcherBroken, DeadlineExceeded, PredictFailed, ShuttingDown
from app.ops.queue_policy import ONE_LEVEL, Priorities

log = logging.getLogger(__name__)


def given_ms(call: Call, wait_s: float | None) -> str:
    """The time a call was given, as its timeout's message names it (what was left, if not known)."""
    given_s = call.timeout_s if call.timeout_s is not None else wait_s or 0.0
    return f"{given_s * 1000:.0f}"


class Batcher:
    """Owns one model's predict function and the one thread that calls it."""

    def __init__(
        self,
        predict_fn: PredictFn,
        *,
        name: str = "default",
        max_batch_size: int = 32,
        batch_timeout_ms: float = 0.0,
        max_queue_rows: int = 1024,
        max_request_rows: int | None = None,
        batching: bool = True,
        whole: bool = False,
        buckets: tuple[int, ...] | None = None,
        bisect_failures: bool = True,
        fill_under_load: bool = True,
        padding: Padding | None = None,
        priorities: Priorities = ONE_LEVEL,
        observer: BatchObserver | None = None,
        on_broken: Callable[[Batcher], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_request_rows = min(max_request_rows or max_queue_rows, max_queue_rows)
        # Off: one request per predict call (each still split to max_batch_size and padded).
        self.batching = batching and not whole
        # Whole: one request per call as the client sent it, for a signature with no batch
        # dimension to split, pad or check; it counts as one row against the queue's limits.
        self.whole = whole
        self.buckets = buckets if buckets is not None else bucket_sizes(max_batch_size)
        if self.buckets[-1] < max_batch_size:
            raise ValueError("the largest bucket must hold max_batch_size rows")
        # Variable-length padding: None keeps requests of different per-row shapes apart.
        self.padding = padding
        self.observer = observer or BatchObserver()
        self._hooks = GuardedObserver(self.observer, name)
        self._on_broken = on_broken
        self._clock = clock
        self.queue = RowQueue(name=name, max_rows=max_queue_rows, observer=self._hooks, priorities=priorities)
        self.priorities = priorities
        # Per level: how long a request may wait queued (its policy's default timeout), or None.
        self._level_timeouts = [priorities.policy(index).default_timeout_s or None
                                for index in range(priorities.levels)]
        self.fill_policy = FillPolicy(max_batch_size=max_batch_size, batch_timeout_s=batch_timeout_ms / 1000.0,
                                      fill_under_load=fill_under_load)
        self.executor = Executor(predict_fn, name=name, buckets=self.buckets, bisect_failures=bisect_failures,
                                 padding=padding, whole=whole, observer=self._hooks, clock=clock,
                                 waiting=self.queue.waiting)
        self.info = EngineInfo(name, self.max_request_rows, max_batch_size, self.fill_policy.batch_timeout_s,
                               self.fill_policy.fill_under_load, whole, padding is not None)
        self._drain = True
        self.batches_run = 0
        self._thread = threading.Thread(target=self._run, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    # -- request threads -------------------------------------------------------------

    def submit(self, call: Call, inputs: Tensors) -> concurrent.futures.Future[BatchResult]:
        """Queue the call's rows; the future resolves to a BatchResult or a ServingError.

        The queued work item keeps the call: its deadline drops the rows unrun once passed, its
        `client_gone` is asked just before its first rows run (True: dropped unrun, its future
        cancelled, and counted), and its trace reaches the observer's `predict_call` with every
        call that runs its rows. The call's priority picks its level (0: the model's default); a
        request still queued when its level's queue timeout passes fails with DeadlineExceeded.
        """
        rows = 1 if self.whole else request_rows(inputs, max_rows=self.max_request_rows)
        if self.padding is not None:
            check_lengths(inputs, self.padding)
        now = self._clock()
        pending = Pending(call, inputs, rows, now, self.padding)
        pending.level = level = self.priorities.index(call.priority)
        queue_timeout_s = self._level_timeouts[level]
        if queue_timeout_s is not None and (pending.deadline is None or now + queue_timeout_s < pending.deadline):
            pending.deadline = now + queue_timeout_s
        # A request abandoned (cancelled, failed, answered) stops counting against the queue at once,
        # not when the batch thread reaches it.
        # Called with the future, which is the request itself (typed as the Future it extends).
        pending.add_done_callback(self.queue.uncount)  # type: ignore[arg-type]
        self.queue.put(pending)
        return pending

    def predict(self, call: Call, inputs: Tensors) -> BatchResult:
        """Submit and wait until the call's deadline; the rows are dropped unrun if it passes while
        they queue (or their level's queue timeout does: the batch thread answers them then)."""
        # On the batcher's clock, the one its batch thread reads deadlines by.
        return wait(self, call, self.submit(call, inputs), now=self._clock())

    def give_up(self, future: concurrent.futures.Future[BatchResult], call: Call, waited_s: float | None,
                ) -> BatchResult:
        """The call's deadline passed while `future` (from submit) was pending: its rows are dropped
        unrun (DeadlineExceeded), unless its answer landed meanwhile: then it stands."""
        late = DeadlineExceeded(f"no result from model '{self.name}' within {given_ms(call, waited_s)} ms")
        if future.cancel() or settle(future, exception=late):
            self._hooks.rejected("deadline")
            raise late
        return future.result(0)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting; answer everything accepted (drain) or fail it with ShuttingDown.

        A later close(drain=False) still stops a drain that an earlier close began (e.g. one
        that timed out): what is not yet running is failed instead of run.
        """
        if not drain:
            self._drain = False  # before the queue wakes the thread, so that it sees it
        self.queue.close()
        self._thread.join(timeout_s)

    def flush(self, *, later_too: bool = False) -> None:
        """Run what is queued now without waiting out its window (BATCH_TIMEOUT_MS), as close()
        does, but keep serving: the requests come from a worker that is stopping. With
        `later_too`, no later batch waits for company either: the process itself is stopping."""
        self.queue.flush(math.inf if later_too else self._clock())

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the batch thread to end (after close(), or after it died)."""
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self.queue.broken is None and self._thread.is_alive()

    @property
    def broken(self) -> bool:
        """True once the batch thread died rather than stopped: this batcher never serves again."""
        return self.queue.broken is not None or (not self.queue.closed and not self._thread.is_alive())

    @property
    def queued_rows(self) -> int:
        return self.queue.queued_rows

    @property
    def batch_timeout_s(self) -> float:
        return self.fill_policy.batch_timeout_s

    @property
    def fill_under_load(self) -> bool:
        return self.fill_policy.fill_under_load

    # -- the batch thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical("batch thread of model '%s' died", self.name, exc_info=True)
            self._break(exc)

    def _loop(self) -> None:
        while True:
            backlog = self.queue.get()
            if not backlog or self._aborting:
                break
            batch = self._gather(backlog)
            if self._aborting:
                break
            if batch.slices:
                self._run_batch(batch)
            self.queue.forget_done()
        if self._aborting:
            self._fail_remaining(ShuttingDown("the server shut down before this request ran"))

    @property
    def _aborting(self) -> bool:
        return self.queue.closed and not self._drain

    def _gather(self, backlog: Iterable[Pending]) -> Batch:
        batch = Batch(self.max_batch_size)
        self._fill(batch, backlog)
        if not (self.batching and batch.slices) or batch.full:
            return batch
        oldest = batch.slices[0].pending.enqueued_at
        wait = self.fill_policy.decide(oldest_enqueued_at=oldest, now=self._clock())
        if wait is None:
            return batch
        while not batch.full and len(batch.slices) < wait.requests:
            more = self.queue.wait_for_arrivals(requests=wait.requests - len(batch.slices),
                                                rows=batch.max_rows - batch.rows, until=wait.until, clock=self._clock,
                                                oldest=oldest)
            if more is None:
                break  # the window closed, a flush came, or the server is stopping: go now
            self._fill(batch, more)
        return batch

    def _fill(self, batch: Batch, backlog: Iterable[Pending]) -> None:
        """Take rows from the backlog, oldest first, of the batch's shape, until it is full."""
        now = self._clock()  # once per pass, not per request: the pass takes microseconds
        for pending in backlog:
            if batch.full or (batch.slices and not self.batching):
                return
            if not pending.remaining or drop_if_abandoned(pending, now, self._hooks):
                continue
            if batch.key is None:
                batch.key = pending.key
            if pending.key == batch.key:
                batch.take(pending)

    def _run_batch(self, batch: Batch) -> None:
        now = self._clock()
        slices = [piece for piece in batch.slices if start(piece.pending, now, self._hooks)]
        if not slices:
            return
        # Rows count as queued until their predict call starts (a forming batch waits too);
        # released together, once per batch, not once per request.
        self.queue.release([(piece.pending, piece.rows) for piece in slices])
        # One try around the whole batch: whatever goes wrong reaches every future in it,
        # or those requests would wait until their deadline for an answer that never comes.
        try:
            stats = self.executor.run(slices)
        except Exception as exc:
            log.exception("batch of model '%s' failed outside its predict call", self.name)
            error = PredictFailed.from_exception(exc)
            for piece in slices:
                settle(piece.pending, exception=error)
        else:
            if stats is not None:
                self.fill_policy.record(stats)
        self.batches_run += 1

    def _fail_remaining(self, error: Exception) -> None:
        # Settled outside the queue's mutex: each future's done-callback takes it to release its rows.
        for pending in self.queue.unfinished():
            settle(pending, exception=error)
            pending.notify_if_cancelled()

    def _break(self, exc: BaseException) -> None:
        self.queue.close(broken=exc)
        self._fail_remaining(BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died ({exc!r})"))
        if self._on_broken is not None:
            try:
                self._on_broken(self)
            except Exception:
                log.exception("on_broken of model '%s' failed", self.name)
