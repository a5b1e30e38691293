"""The dynamic batching engine: request threads submit rows, one daemon thread predicts.

Request threads call `Batcher.submit()` (or `predict()`), which queues a `_Pending`
holding the rows and a `Future`. The batch thread waits for the oldest pending request,
then takes, without waiting, every queued request whose rows have the same per-row shape
and dtype, up to `max_batch_size` rows. With `batch_timeout_ms > 0` it waits for more
until the oldest request has waited that long; with the default 0 it dispatches at once,
so batches grow by themselves while the previous batch runs.

Under load, "at once" leaves rows on the table: with clients that send their next request as
soon as they have an answer, the requests of one batch come back while the next one runs,
and the two halves take turns at half the batch size, for good (measured: 16-row batches from
32 clients, with a model whose cost per row halves from 16 to 32 rows). So with
`fill_under_load`, a batch that is not full may wait for more rows, at most as long as the
last predict call took (the model idles at most as long as it last ran), in two cases:

- the last call answered at least a quarter of a full batch (at least 3 requests) and the
  first request back came soon after it (within the call's own time and 2 ms for each
  request it answered, FILL_RETURN_S_PER_REQUEST): a closed loop's clients are
  all in that call, so none waits through it, and they come straight back. The batch waits
  for as many requests as were around that call (those it answered and those that waited
  through it), not for a full batch: a loop of fewer clients than a batch holds would
  otherwise idle the model a whole window every call. A request that comes later follows
  a burst that has ended, and goes at once;
- requests waited through the last call and, with those it answered, made a quarter of a
  batch: the load is rising, and the batch waits to be full.

At low load a call answers one or two requests and nobody waits through it: a request is
dispatched at once as before.

The batch is padded up to the next bucket size (powers of two up to `max_batch_size`),
so the model only ever sees shapes it was warmed with, and each request gets its own
rows back through its future. This module imports no TensorFlow: the predict function
is injected, and the unit tests drive the engine with a fake one.

What no caller may ever see is a future that nobody will finish. So a request the batch
thread has taken stays in its backlog until its future is done, and the failure path
walks the backlog and the arrivals: whatever kills the thread, every request is answered.
Observer hooks cannot break the thread (a failing hook is logged); a failure while
delivering fails only the requests it concerns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from app.errors import (
    BadRequest,
    BatcherBroken,
    DeadlineExceeded,
    InvalidInput,
    PayloadTooLarge,
    PredictFailed,
    QueueFull,
    ServingError,
    ShuttingDown,
)

log = logging.getLogger(__name__)

Tensors = Mapping[str, np.ndarray]
PredictFn = Callable[[dict[str, np.ndarray]], Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What a request gets back: its own output rows and how its (last) batch looked."""

    outputs: dict[str, np.ndarray]
    batch_rows: int
    batch_requests: int


class BatchObserver:
    """Hooks the engine calls; the default does nothing. A hook that raises is logged and ignored.

    `queue_depth` is called with the batcher's lock held, so successive calls report the
    queued rows in the order they changed: a gauge set from it never ends on a stale value.
    """

    def queue_depth(self, rows: int) -> None:
        pass

    def queue_wait(self, seconds: float) -> None:
        pass

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass


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


def max_predict_calls(requests: int) -> int:
    """Predict calls a failing batch may make while bisecting: enough to isolate two poisoned
    requests, far fewer than the 2n - 1 that would prove each of n failing requests alone."""
    return 1 + 4 * (requests - 1).bit_length()


class _Pending:
    """One submitted request: its rows, its future, and how far the batch thread got."""

    __slots__ = ("inputs", "future", "rows", "key", "enqueued_at", "deadline", "next_row", "parts", "started",
                 "counted")

    def __init__(self, inputs: Tensors, rows: int, enqueued_at: float, deadline: float | None):
        self.inputs = inputs
        self.future: concurrent.futures.Future[BatchResult] = concurrent.futures.Future()
        self.rows = rows
        # Requests share a batch only if every input has the same per-row shape and dtype.
        self.key = tuple(sorted((name, arr.shape[1:], arr.dtype.str) for name, arr in inputs.items()))
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.next_row = 0
        self.started = False
        self.parts: list[Mapping[str, np.ndarray]] = []
        # Rows of this request still counted against max_queue_rows (changed under the batcher's lock).
        self.counted = 0

    @property
    def remaining(self) -> int:
        return self.rows - self.next_row

    def deliver(self, outputs: dict[str, np.ndarray], batch_rows: int, batch_requests: int, done: bool) -> None:
        if self.future.done():
            return
        if not done:
            self.parts.append(outputs)
            return
        if self.parts:
            self.parts.append(outputs)
            try:
                outputs = {name: np.concatenate([part[name] for part in self.parts]) for name in outputs}
            except (ValueError, KeyError) as exc:
                # E.g. a model whose output width follows the batch: this request alone cannot be answered.
                _settle(self.future, exception=PredictFailed(
                    f"the outputs of the batches that held this request's rows do not join: {exc}"))
                return
            finally:
                self.parts = []
        _settle(self.future, result=BatchResult(outputs, batch_rows, batch_requests))


def _settle(future: concurrent.futures.Future, *, result: Any = None, exception: BaseException | None = None) -> bool:
    """Finish the future unless something already did (an earlier chunk failed, a caller gave up)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True


@dataclasses.dataclass
class _Slice:
    pending: _Pending
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class _Batch:
    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.slices: list[_Slice] = []
        self.rows = 0
        self.key: tuple | None = None

    @property
    def full(self) -> bool:
        return self.rows >= self.max_rows

    def take(self, pending: _Pending) -> None:
        count = min(pending.remaining, self.max_rows - self.rows)
        start = pending.next_row
        pending.next_row += count
        self.slices.append(_Slice(pending, start, start + count))
        self.rows += count


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
        buckets: tuple[int, ...] | None = None,
        bisect_failures: bool = True,
        fill_under_load: bool = True,
        retry_after_s: int = 1,
        observer: BatchObserver | None = None,
        on_broken: Callable[[Batcher], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.name = name
        self.max_batch_size = max_batch_size
        self.batch_timeout_s = batch_timeout_ms / 1000.0
        self.max_queue_rows = max_queue_rows
        self.max_request_rows = min(max_request_rows or max_queue_rows, max_queue_rows)
        self.batching = batching
        self.buckets = buckets if buckets is not None else bucket_sizes(max_batch_size)
        if self.buckets[-1] < max_batch_size:
            raise ValueError("the largest bucket must hold max_batch_size rows")
        self.bisect_failures = bisect_failures
        self.fill_under_load = fill_under_load
        self.retry_after_s = retry_after_s
        self.observer = observer or BatchObserver()
        self._on_broken = on_broken
        self._predict_fn = predict_fn
        self._clock = clock
        # One lock for submit, close and the row count, as in concurrent.futures.thread:
        # nothing is queued after shutdown began, and the count changes in one order.
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        # Submitted, not yet seen by the batch thread.
        self._incoming: collections.deque[_Pending] = collections.deque()
        self._incoming_rows = 0
        # A submit wakes the batch thread only once this many requests, or rows, have arrived
        # since it last looked: a batch filling under load waits for a count it knows, and
        # waking it for every arrival would cost each request a thread switch and a GIL
        # hand-off on the path between two predict calls.
        self._wake_requests = 1
        self._wake_rows = 1
        # Seen by the batch thread, future not done yet: only the batch thread changes it.
        self._backlog: collections.deque[_Pending] = collections.deque()
        self._queued_rows = 0
        self._shutdown = False
        self._drain = True
        self._broken: BaseException | None = None
        self._failed_hooks: set[str] = set()
        self.batches_run = 0
        # Of the last predict call: how long it took, when it ended, how many requests it
        # answered, and how many waited through it.
        self._last_predict_s = 0.0
        self._last_call_ended = 0.0
        self._answered_by_last = 0
        self._waited_through_last = 0
        self._thread = threading.Thread(target=self._run, name=f"batcher-{name}", daemon=True)
        self._thread.start()

    # -- request threads -------------------------------------------------------------

    def submit(self, inputs: Tensors, *, timeout_s: float | None = None) -> concurrent.futures.Future[BatchResult]:
        """Queue the rows; the future resolves to a BatchResult or a ServingError."""
        rows = row_count(inputs)
        if rows == 0:
            raise InvalidInput("the request holds no rows")
        if rows > self.max_request_rows:
            raise PayloadTooLarge(
                f"the request holds {rows} rows; model '{self.name}' takes at most {self.max_request_rows} "
                "rows per request (MAX_REQUEST_ROWS)"
            )
        now = self._clock()
        pending = _Pending(inputs, rows, now, None if timeout_s is None else now + timeout_s)
        # A request abandoned (cancelled, failed, answered) stops counting against the queue at once,
        # not when the batch thread reaches it.
        pending.future.add_done_callback(lambda _future: self._uncount(pending))
        with self._lock:
            if self._broken is not None:
                raise BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died")
            if self._shutdown:
                self._notify("rejected", "shutting_down")
                raise ShuttingDown("the server is shutting down")
            if self._queued_rows + rows > self.max_queue_rows:
                self._notify("rejected", "queue_full")
                raise QueueFull(
                    f"model '{self.name}' is overloaded: {self._queued_rows} rows are waiting "
                    f"and at most {self.max_queue_rows} may (MAX_QUEUE_ROWS); retry later",
                    retry_after_s=self.retry_after_s,
                )
            pending.counted = rows
            self._queued_rows += rows
            self._notify("queue_depth", self._queued_rows)
            self._incoming.append(pending)
            self._incoming_rows += rows
            if len(self._incoming) >= self._wake_requests or self._incoming_rows >= self._wake_rows:
                self._arrived.notify()
        return pending.future

    def predict(self, inputs: Tensors, *, timeout_s: float) -> BatchResult:
        """Submit and wait, at most timeout_s; the request is dropped unrun if it expires queued."""
        future = self.submit(inputs, timeout_s=timeout_s)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            pass
        # Give the request up, unless its answer landed between the timeout and now: then it stands.
        late = DeadlineExceeded(f"no result from model '{self.name}' within {timeout_s * 1000:.0f} ms")
        if future.cancel() or _settle(future, exception=late):
            self._notify("rejected", "deadline")
            raise late
        return future.result(0)

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting; answer everything accepted (drain) or fail it with ShuttingDown.

        A later close(drain=False) still stops a drain that an earlier close began (e.g. one
        that timed out): what is not yet running is failed instead of run.
        """
        with self._lock:
            self._shutdown = True
            if not drain:
                self._drain = False
            self._arrived.notify_all()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._broken is None and self._thread.is_alive()

    @property
    def broken(self) -> bool:
        """True once the batch thread died rather than stopped: this batcher never serves again."""
        return self._broken is not None or (not self._shutdown and not self._thread.is_alive())

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    # -- the row count ---------------------------------------------------------------

    def _uncount(self, pending: _Pending) -> None:
        """Stop counting whatever rows of a request still count (its future is done)."""
        # Lock-free when nothing is left: counted only falls, and an answered request's rows
        # were released when its predict call started.
        if pending.counted:
            self._release([(pending, pending.counted)])

    def _release(self, releases: list[tuple[_Pending, int]]) -> None:
        """Stop counting rows of requests, each row once; the gauge hears of it once per call."""
        with self._lock:
            released = 0
            for pending, rows in releases:
                rows = min(rows, pending.counted)
                pending.counted -= rows
                released += rows
            if released:
                self._queued_rows -= released
                self._notify("queue_depth", self._queued_rows)

    def _notify(self, hook: str, *args: Any, **kwargs: Any) -> None:
        # Metrics must never cost a request its answer, nor the batch thread its life.
        try:
            getattr(self.observer, hook)(*args, **kwargs)
        except Exception:
            if hook not in self._failed_hooks:
                self._failed_hooks.add(hook)
                log.exception("observer hook %s of model '%s' failed (logged once)", hook, self.name)

    # -- the batch thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.critical("batch thread of model '%s' died", self.name, exc_info=True)
            self._break(exc)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._incoming and not self._backlog and not self._shutdown:
                    self._arrived.wait()
                self._admit()
            if not self._backlog or self._aborting:
                break
            batch = self._gather()
            if self._aborting:
                break
            if batch.slices:
                self._run_batch(batch)
            self._prune()
        if self._aborting:
            self._fail_remaining(ShuttingDown("the server shut down before this request ran"))

    def _prune(self) -> None:
        # Only answered requests leave the backlog: whatever stops the thread, the rest are found.
        for pending in self._backlog:
            if pending.future.done():
                _notify_cancelled(pending)
        self._backlog = collections.deque(p for p in self._backlog if not p.future.done())

    @property
    def _aborting(self) -> bool:
        return self._shutdown and not self._drain

    def _admit(self) -> None:
        # Caller holds the lock. Into the backlog first, then out of the arrivals: a request
        # is always in one of them (or both), never in neither.
        self._backlog.extend(self._incoming)
        self._incoming.clear()
        self._incoming_rows = 0

    def _gather(self) -> _Batch:
        batch = _Batch(self.max_batch_size)
        self._fill(batch)
        enough_requests = self.max_batch_size  # one row each at least: reached only when full
        if not (self.batching and batch.slices) or batch.full:
            return batch
        if self.batch_timeout_s > 0:
            # Wait for more until the oldest has waited its window; past it, still take what is
            # already queued: under load the oldest has often waited its window out behind the last batch.
            wait_until = batch.slices[0].pending.enqueued_at + self.batch_timeout_s
        elif self.fill_under_load and ((returning := self._loop_returning(batch)) or self._load_rising()):
            wait_until = self._clock() + self._last_predict_s
            if returning:
                # The clients of a closed loop: those just answered come straight back, and no
                # more. Waiting for a full batch past them would idle the model a whole window.
                enough_requests = self._answered_by_last + self._waited_through_last
        else:
            return batch
        while not batch.full and len(batch.slices) < enough_requests:
            with self._lock:
                self._wake_requests = enough_requests - len(batch.slices)
                self._wake_rows = batch.max_rows - batch.rows
                try:
                    while (len(self._incoming) < self._wake_requests and self._incoming_rows < self._wake_rows
                           and not self._shutdown):
                        remaining = wait_until - self._clock()
                        if remaining <= 0 or not self._arrived.wait(remaining):
                            break
                finally:
                    self._wake_requests = self._wake_rows = 1
                if not self._incoming:
                    break  # the window closed, or the server is stopping: go now
                self._admit()
            self._fill(batch)
        return batch

    def _fill(self, batch: _Batch) -> None:
        """Take rows from the backlog, oldest first, of the batch's shape, until it is full."""
        for pending in self._backlog:
            if batch.full or (batch.slices and not self.batching):
                return
            if not pending.remaining or self._abandoned(pending):
                continue
            if batch.key is None:
                batch.key = pending.key
            if pending.key == batch.key:
                batch.take(pending)

    def _abandoned(self, pending: _Pending) -> bool:
        """True for requests nobody waits for any more: cancelled, failed, or past their deadline."""
        if pending.future.done():
            return True
        if pending.deadline is not None and self._clock() >= pending.deadline:
            if _settle(pending.future, exception=DeadlineExceeded("the request's deadline passed before it ran")):
                self._notify("rejected", "deadline")
            return True
        return False

    def _start(self, piece: _Slice) -> bool:
        """Last check before a predict call: a request cancelled or expired meanwhile is left out."""
        pending = piece.pending
        if self._abandoned(pending):
            return False
        if not pending.started:
            pending.started = True
            if not pending.future.set_running_or_notify_cancel():
                return False
            self._notify("queue_wait", self._clock() - pending.enqueued_at)
        return True

    def _run_batch(self, batch: _Batch) -> None:
        slices = [piece for piece in batch.slices if self._start(piece)]
        if not slices:
            return
        # Rows count as queued until their predict call starts (a forming batch waits too);
        # released together, once per batch, not once per request.
        self._release([(piece.pending, piece.rows) for piece in slices])
        # One try around the whole batch: whatever goes wrong reaches every future in it,
        # or those requests would wait until their deadline for an answer that never comes.
        try:
            self._execute(slices)
        except Exception as exc:
            log.exception("batch of model '%s' failed outside its predict call", self.name)
            error = PredictFailed.from_exception(exc)
            for piece in slices:
                _settle(piece.pending.future, exception=error)
        self.batches_run += 1

    def _execute(self, slices: list[_Slice]) -> None:
        """Predict; on failure retry halves (depth first) so that a poisoned request fails alone,
        within a budget of calls, and never for requests whose deadline has passed."""
        calls_left = max_predict_calls(len(slices)) if self.bisect_failures else 1
        parts: list[tuple[list[_Slice], ServingError | None]] = [(slices, None)]
        while parts:
            part, earlier_error = parts.pop()
            if earlier_error is not None:
                part = [piece for piece in part if not self._abandoned(piece.pending)]
                if not part:
                    continue
                if calls_left == 0:
                    self._fail(part, earlier_error)
                    continue
            calls_left -= 1
            try:
                outputs, rows, padded, predict_s = self._predict(part)
                self._last_predict_s = predict_s
                self._last_call_ended = self._clock()
                self._answered_by_last = len(part)
                self._waited_through_last = self._waiting_requests()
            except Exception as exc:
                error = exc if isinstance(exc, ServingError) else PredictFailed.from_exception(exc)
                if len(part) > 1 and calls_left > 0:
                    middle = len(part) // 2
                    parts += [(part[middle:], error), (part[:middle], error)]
                else:
                    self._fail(part, error)
                continue
            self._notify("batch_done", rows=rows, requests=len(part), padded_rows=padded - rows,
                         predict_s=predict_s)
            offset = 0
            for piece in part:
                own = {name: out[offset : offset + piece.rows] for name, out in outputs.items()}
                piece.pending.deliver(own, rows, len(part), done=piece.stop == piece.pending.rows)
                offset += piece.rows

    @property
    def _fill_wanted(self) -> int:
        return max(FILL_UNDER_LOAD_MIN_REQUESTS, self.max_batch_size // FILL_UNDER_LOAD_SHARE)

    def _loop_returning(self, batch: _Batch) -> bool:
        """The last call answered a quarter of a batch, and this batch's oldest request came soon
        after it: the clients of a closed loop, not a burst that has ended."""
        came_after_s = batch.slices[0].pending.enqueued_at - self._last_call_ended
        soon_s = self._last_predict_s + self._answered_by_last * FILL_RETURN_S_PER_REQUEST
        return self._answered_by_last >= self._fill_wanted and came_after_s <= soon_s

    def _load_rising(self) -> bool:
        around_last_call = self._answered_by_last + self._waited_through_last
        return self._waited_through_last >= 1 and around_last_call >= self._fill_wanted

    def _waiting_requests(self) -> int:
        """Requests queued and not finished taking (the batch thread's view; arrivals counted unlocked)."""
        return len(self._incoming) + sum(1 for pending in self._backlog if pending.remaining)

    def _predict(self, part: list[_Slice]) -> tuple[dict[str, np.ndarray], int, int, float]:
        inputs = _concatenate(part)
        rows = sum(piece.rows for piece in part)
        padded = next(size for size in self.buckets if size >= rows)
        if padded > rows:
            inputs = {name: _pad(arr, padded) for name, arr in inputs.items()}
        started = self._clock()
        outputs = _check_outputs(self._predict_fn(inputs), padded)
        return outputs, rows, padded, self._clock() - started

    def _fail(self, part: list[_Slice], error: ServingError) -> None:
        log.warning("predict of model '%s' failed for %d request(s): %s", self.name, len(part), error)
        for piece in part:
            _settle(piece.pending.future, exception=error)

    def _fail_remaining(self, error: ServingError) -> None:
        with self._lock:
            waiting = [*self._backlog, *self._incoming]
        # Settled outside the lock: each future's done-callback takes it to release its rows.
        for pending in waiting:
            _settle(pending.future, exception=error)
            _notify_cancelled(pending)

    def _break(self, exc: BaseException) -> None:
        with self._lock:
            self._broken = exc
        self._fail_remaining(BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died ({exc!r})"))
        if self._on_broken is not None:
            try:
                self._on_broken(self)
            except Exception:
                log.exception("on_broken of model '%s' failed", self.name)


def _notify_cancelled(pending: _Pending) -> None:
    # As concurrent.futures' executors do: until this call, concurrent.futures.wait() and
    # as_completed() do not count a cancelled future as done, and would wait for it forever.
    if pending.future.cancelled() and not pending.started:
        pending.started = True
        pending.future.set_running_or_notify_cancel()


def _concatenate(slices: list[_Slice]) -> dict[str, np.ndarray]:
    first = slices[0]
    if len(slices) == 1 and first.start == 0 and first.stop == first.pending.rows:
        return dict(first.pending.inputs)
    return {
        name: np.concatenate([s.pending.inputs[name][s.start : s.stop] for s in slices])
        for name in first.pending.inputs
    }


def _pad(arr: np.ndarray, rows: int) -> np.ndarray:
    # Repeat the last row rather than add zeros: valid for any dtype, strings included.
    return np.concatenate([arr, np.repeat(arr[-1:], rows - arr.shape[0], axis=0)])


def _check_outputs(outputs: Mapping[str, Any], rows: int) -> dict[str, np.ndarray]:
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
