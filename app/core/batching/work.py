"""The work item: one request's rows, its future, and how far the batch thread got with it."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from app.core.batching.observer import BatchObserver, GuardedObserver
from app.core.batching.rows import Padding, Tensors, batch_key
from app.core.call import Call
from app.core.errors import DeadlineExceeded, PredictFailed


@dataclasses.dataclass(frozen=True)
class BatchResult:
    """What a request gets back: its own output rows and how its (last) batch looked."""

    outputs: dict[str, np.ndarray]
    batch_rows: int
    batch_requests: int


class Pending(concurrent.futures.Future[BatchResult]):
    """One submitted request: its call, its rows, and how far the batch thread got; it is its
    own future (one object a request, not two), and `submit` hands it out as a plain Future."""

    __slots__ = ("call", "inputs", "rows", "key", "enqueued_at", "deadline", "priority", "next_row", "parts",
                 "started", "counted", "level")

    def __init__(self, call: Call, inputs: Tensors, rows: int, enqueued_at: float,
                 padding: Padding | None = None) -> None:
        super().__init__()
        # The whole call: its client-gone check and its trace are read from it on the batch thread.
        self.call = call
        self.inputs = inputs
        self.rows = rows
        key = batch_key(inputs, padding)
        # A handler's batch key: rows of another group never share the call (app/core/handlers.py).
        self.key: Hashable = key if call.group is None else (call.group, key)
        self.enqueued_at = enqueued_at
        # The call's, as fields: the row queue and the fill read them for every request they look at.
        self.deadline = call.deadline
        self.priority = call.priority
        self.next_row = 0
        self.started = False
        self.parts: list[Mapping[str, np.ndarray]] = []
        # Rows of this request still counted against max_queue_rows (changed under the queue's mutex).
        self.counted = 0
        # The 0-based level the batcher resolved the call's priority to: the row queue keeps one queue per level.
        self.level = 0

    @property
    def remaining(self) -> int:
        return self.rows - self.next_row

    def deliver(self, outputs: dict[str, np.ndarray], batch_rows: int, batch_requests: int, done: bool) -> None:
        if not done:
            if not self.done():
                self.parts.append(outputs)
            return
        if self.parts:
            if self.done():
                self.parts = []
                return
            self.parts.append(outputs)
            try:
                outputs = {name: np.concatenate([part[name] for part in self.parts]) for name in outputs}
            except (ValueError, KeyError) as exc:
                # E.g. a model whose output width follows the batch: this request alone cannot be answered.
                settle(self, exception=PredictFailed(
                    f"the outputs of the batches that held this request's rows do not join: {exc}"))
                return
            finally:
                self.parts = []
        settle(self, result=BatchResult(outputs, batch_rows, batch_requests))

    def notify_if_cancelled(self) -> None:
        # As concurrent.futures' executors do: until this call, concurrent.futures.wait() and
        # as_completed() do not count a cancelled future as done, and would wait for it forever.
        if self.cancelled() and not self.started:
            self.started = True
            self.set_running_or_notify_cancel()


class Slice:
    """Rows start:stop of one request, as one batch holds them (`last`: the request's last rows)."""

    __slots__ = ("pending", "start", "stop", "rows", "last")

    def __init__(self, pending: Pending, start: int, stop: int) -> None:
        self.pending = pending
        self.start = start
        self.stop = stop
        # Fields, not properties: read several times a request on the batch thread.
        self.rows = stop - start
        self.last = stop == pending.rows

    def __repr__(self) -> str:
        return f"Slice(rows {self.start}:{self.stop} of {self.pending.rows})"


class Batch:
    """Slices of compatible requests, at most max_rows rows in all."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.slices: list[Slice] = []
        self.rows = 0
        self.key: Hashable | None = None

    @property
    def full(self) -> bool:
        return self.rows >= self.max_rows

    def take(self, pending: Pending) -> None:
        count = min(pending.remaining, self.max_rows - self.rows)
        start = pending.next_row
        pending.next_row += count
        self.slices.append(Slice(pending, start, start + count))
        self.rows += count


def settle(future: concurrent.futures.Future, *, result: Any = None, exception: BaseException | None = None) -> bool:
    """Finish the future unless something already did (an earlier chunk failed, a caller gave up)."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        return False
    return True


def drop_if_abandoned(pending: Pending, now: float, observer: BatchObserver) -> bool:
    """True for a request nobody waits for any more: cancelled, failed, or past its deadline
    (its future then fails with DeadlineExceeded, counted once as a rejection)."""
    return pending.done() or expired(pending, now, observer)


def expired(pending: Pending, now: float, observer: BatchObserver) -> bool:
    """True for a request past its deadline: its future fails with DeadlineExceeded, counted
    once as a rejection (not if something finished it first)."""
    if pending.deadline is not None and now >= pending.deadline:
        if settle(pending, exception=DeadlineExceeded("the request's deadline passed before it ran")):
            observer.rejected("deadline")
        return True
    return False


def start(pending: Pending, now: float, hooks: GuardedObserver) -> bool:
    """The last check before a predict call, the clock reading `now`: False leaves out a request
    cancelled or expired meanwhile, or one whose client has gone (asked before its first rows run only)."""
    if pending.started:
        return not drop_if_abandoned(pending, now, hooks)
    # Not started, so nothing but a cancel can have finished it since the fill looked, and
    # set_running_or_notify_cancel() answers that: no look at the future (its lock) first.
    if expired(pending, now, hooks):
        return False
    client_gone = pending.call.client_gone
    if client_gone is not None and hooks.guarded("client_gone", client_gone):
        if pending.cancel():
            hooks.rejected("client_gone")
        pending.notify_if_cancelled()
        return False
    pending.started = True
    try:
        if not pending.set_running_or_notify_cancel():
            return False
    except RuntimeError:  # finished meanwhile after all: nothing left to run
        return False
    hooks.queue_wait(now - pending.enqueued_at)
    return True
