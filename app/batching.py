"""The dynamic batching engine: request threads submit rows, one daemon thread predicts.

Request threads call `Batcher.submit()` (or `predict()`), which queues a `_Pending`
holding the rows and a `Future`. The batch thread blocks on the queue for the oldest
pending request, then takes, without waiting, every queued request whose rows have the
same per-row shape and dtype, up to `max_batch_size` rows. With `batch_timeout_ms > 0`
it waits for more until the oldest request has waited that long; with the default 0 it
dispatches at once, so batches grow by themselves while the previous batch runs.

The batch is padded up to the next bucket size (powers of two up to `max_batch_size`),
so the model only ever sees shapes it was warmed with, and each request gets its own
rows back through its future. This module imports no TensorFlow: the predict function
is injected, and the unit tests drive the engine with a fake one.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import queue
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

_STOP = object()


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What a request gets back: its own output rows and how its (last) batch looked."""

    outputs: dict[str, np.ndarray]
    batch_rows: int
    batch_requests: int


class BatchObserver:
    """Hooks the engine calls from its thread; the default does nothing."""

    def queue_depth(self, rows: int) -> None:
        pass

    def queue_wait(self, seconds: float) -> None:
        pass

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        pass

    def rejected(self, reason: str) -> None:
        pass


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


class _Pending:
    """One submitted request: its rows, its future, and how far the batch thread got."""

    __slots__ = ("inputs", "future", "rows", "key", "enqueued_at", "deadline", "next_row", "parts", "started")

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
            outputs = {name: np.concatenate([part[name] for part in self.parts]) for name in outputs}
            self.parts = []
        _settle(self.future, result=BatchResult(outputs, batch_rows, batch_requests))


def _settle(future: concurrent.futures.Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    # A future may already be finished (an earlier chunk failed, or shutdown failed it).
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


@dataclasses.dataclass
class _Slice:
    pending: _Pending
    start: int
    stop: int


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
        retry_after_s: int = 1,
        observer: BatchObserver | None = None,
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
        self.retry_after_s = retry_after_s
        self.observer = observer or BatchObserver()
        self._predict_fn = predict_fn
        self._clock = clock
        self._queue: queue.Queue[Any] = queue.Queue()
        # Requests taken off the queue but not finished: only the batch thread touches it.
        self._backlog: collections.deque[_Pending] = collections.deque()
        self._in_flight: list[_Slice] = []
        self._lock = threading.Lock()
        self._queued_rows = 0
        self._shutdown = False
        self._drain = True
        self._broken: BaseException | None = None
        self.batches_run = 0
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
        with self._lock:
            if self._broken is not None:
                raise BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died")
            if self._shutdown:
                self.observer.rejected("shutting_down")
                raise ShuttingDown("the server is shutting down")
            if self._queued_rows + rows > self.max_queue_rows:
                self.observer.rejected("queue_full")
                raise QueueFull(
                    f"model '{self.name}' is overloaded: {self._queued_rows} rows are waiting "
                    f"and at most {self.max_queue_rows} may (MAX_QUEUE_ROWS); retry later",
                    retry_after_s=self.retry_after_s,
                )
            self._queued_rows += rows
            depth = self._queued_rows
            self._queue.put(pending)
        self.observer.queue_depth(depth)
        return pending.future

    def predict(self, inputs: Tensors, *, timeout_s: float) -> BatchResult:
        """Submit and wait, at most timeout_s; the request is dropped unrun if it expires queued."""
        future = self.submit(inputs, timeout_s=timeout_s)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self.observer.rejected("deadline")
            raise DeadlineExceeded(f"no result from model '{self.name}' within {timeout_s * 1000:.0f} ms") from None

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting; answer everything accepted (drain) or fail it with ShuttingDown."""
        with self._lock:
            if not self._shutdown:
                self._shutdown = True
                self._drain = drain
                self._queue.put(_STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._broken is None and self._thread.is_alive()

    @property
    def queued_rows(self) -> int:
        return self._queued_rows

    # -- the batch thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            log.exception("batch thread of model '%s' died", self.name)
            self._break(exc)

    def _loop(self) -> None:
        stopping = False
        while True:
            if self._shutdown and not self._drain:
                self._fail_remaining(ShuttingDown("the server shut down before this request ran"))
                return
            if not self._backlog:
                if stopping:
                    return
                item = self._queue.get()
                if item is _STOP:
                    stopping = True
                    continue
                self._backlog.append(item)
            batch, stopping = self._gather(stopping)
            if batch.slices:
                # Rows count as queued until their predict call starts: a forming batch waits too.
                self._release(batch.rows)
                slices = [piece for piece in batch.slices if self._start(piece.pending)]
                if slices:
                    self._in_flight = slices
                    self._execute(slices)
                    self._in_flight = []
                    self.batches_run += 1

    def _gather(self, stopping: bool) -> tuple[_Batch, bool]:
        batch = _Batch(self.max_batch_size)
        skipped: list[_Pending] = []
        while self._backlog and not batch.full:
            if self._offer(self._backlog.popleft(), batch, skipped) and not self.batching:
                break
        wait_until = None
        while self.batching and not batch.full and not stopping:
            if self.batch_timeout_s > 0 and batch.slices:
                if wait_until is None:
                    wait_until = batch.slices[0].pending.enqueued_at + self.batch_timeout_s
                remaining = wait_until - self._clock()
                # Past the window, still take what is already queued, without waiting: under
                # load the oldest request has often waited its window out behind the last batch.
                item = self._get(timeout=remaining if remaining > 0 else None)
            else:
                item = self._get(timeout=None)
            if item is None:
                break
            if item is _STOP:
                stopping = True
                break
            self._offer(item, batch, skipped)
        self._backlog.extendleft(reversed(skipped))
        return batch, stopping

    def _get(self, *, timeout: float | None) -> Any:
        try:
            if timeout is None:
                return self._queue.get_nowait()
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _offer(self, pending: _Pending, batch: _Batch, skipped: list[_Pending]) -> bool:
        """Put the pending request's rows in the batch if it may join; True if it did."""
        if self._abandoned(pending):
            self._release(pending.remaining)
            return False
        if batch.key is None:
            batch.key = pending.key
        if pending.key != batch.key or (batch.slices and not self.batching):
            skipped.append(pending)
            return False
        batch.take(pending)
        if pending.remaining:
            skipped.append(pending)
        return True

    def _abandoned(self, pending: _Pending) -> bool:
        """True for requests nobody waits for any more: cancelled, failed, or past their deadline."""
        if pending.future.done():
            return True
        if pending.deadline is not None and self._clock() >= pending.deadline:
            self.observer.rejected("deadline")
            _settle(pending.future, exception=DeadlineExceeded("the request's deadline passed while it was queued"))
            return True
        return False

    def _start(self, pending: _Pending) -> bool:
        """Last check before the predict call: a request cancelled while its batch formed is left out."""
        if self._abandoned(pending):
            return False
        if not pending.started:
            pending.started = True
            if not pending.future.set_running_or_notify_cancel():
                return False
            self.observer.queue_wait(self._clock() - pending.enqueued_at)
        return True

    def _release(self, rows: int) -> None:
        with self._lock:
            self._queued_rows -= rows
            depth = self._queued_rows
        self.observer.queue_depth(depth)

    def _execute(self, slices: list[_Slice]) -> None:
        # One try around the whole batch: whatever goes wrong reaches every future in it,
        # or those requests would wait until their deadline for an answer that never comes.
        try:
            inputs = _concatenate(slices)
            rows = sum(s.stop - s.start for s in slices)
            padded = next(size for size in self.buckets if size >= rows)
            if padded > rows:
                inputs = {name: _pad(arr, padded) for name, arr in inputs.items()}
            started = self._clock()
            outputs = _check_outputs(self._predict_fn(inputs), padded)
            predict_s = self._clock() - started
        except Exception as exc:
            if self.bisect_failures and len(slices) > 1:
                # Retry the halves so that one poisonous request fails alone.
                middle = len(slices) // 2
                self._execute(slices[:middle])
                self._execute(slices[middle:])
                return
            error = exc if isinstance(exc, ServingError) else PredictFailed.from_exception(exc)
            log.warning("predict of model '%s' failed for %d request(s): %r", self.name, len(slices), exc)
            for piece in slices:
                _settle(piece.pending.future, exception=error)
            return
        self.observer.batch_done(rows=rows, requests=len(slices), padded_rows=padded - rows, predict_s=predict_s)
        offset = 0
        for piece in slices:
            count = piece.stop - piece.start
            own = {name: out[offset : offset + count] for name, out in outputs.items()}
            piece.pending.deliver(own, rows, len(slices), done=piece.stop == piece.pending.rows)
            offset += count

    def _fail_remaining(self, error: ServingError) -> None:
        for piece in self._in_flight:
            _settle(piece.pending.future, exception=error)
        while self._backlog:
            _settle(self._backlog.popleft().future, exception=error)
        while True:
            item = self._get(timeout=None)
            if item is None:
                break
            if item is not _STOP:
                _settle(item.future, exception=error)
        with self._lock:
            self._queued_rows = 0
        self.observer.queue_depth(0)

    def _break(self, exc: BaseException) -> None:
        with self._lock:
            self._broken = exc
        self._fail_remaining(BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died ({exc!r})"))


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
