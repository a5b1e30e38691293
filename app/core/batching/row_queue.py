"""The row queue: the requests a batcher accepted and has not answered yet, counted in rows.

A `queue.Queue` whose storage and accounting come in through CPython's extension points, as
`PriorityQueue` and `LifoQueue` do theirs: `_put` accepts a request or refuses it, `_get`
hands the batch thread everything there is to do, and the queue's own `mutex` guards it all,
so nothing is queued once `close()` began and the row count changes in one order.

A request is in one of two places from `put()` until its future is done: the arrivals (not
yet seen by the batch thread) or the backlog (seen, not finished; only the batch thread
changes it). `get()` moves the arrivals into the backlog, in that order, so a request is
never in neither: whatever stops the batch thread, `unfinished()` finds every request.

With priority levels (Triton's: 1 is the highest) both places are one deque per level, and
the backlog reads the levels highest first, each oldest first: a batch forms from the
highest level that waits. Each level may also have its own row limit and queue timeout.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator

from app.core.batching.observer import BatchObserver
from app.core.batching.work import Pending
from app.core.errors import BatcherBroken, QueueFull, ShuttingDown
from app.ops.queue_policy import ONE_LEVEL, Priorities


class _Backlog:
    """The levels' backlogs read as one: the highest level first, each oldest first."""

    __slots__ = ("_levels",)

    def __init__(self, levels: list[collections.deque[Pending]]) -> None:
        self._levels = levels

    def __iter__(self) -> Iterator[Pending]:
        return itertools.chain.from_iterable(self._levels)

    def __bool__(self) -> bool:
        return any(self._levels)


class RowQueue(queue.Queue):
    """put() a request, get() the backlog; rows count from put() until released or done.

    get() blocks while there is nothing at all to do, and never once the queue is closed (a
    closed queue reads as non-empty, as 3.13's `Queue.shutdown()` wakes every getter).
    Capacity is in rows, checked by `_put`, so `maxsize` stays 0 and put() never blocks.
    A request leaves when its future is done, not by task_done(): join() is not for this queue.
    """

    _getting: bool  # set by _init

    def __init__(self, *, name: str, max_rows: int, observer: BatchObserver,
                 priorities: Priorities = ONE_LEVEL) -> None:
        self.name = name
        self.max_rows = max_rows
        self._observer = observer
        self.priorities = priorities
        # Per level: the rows it may hold (the model's limit where its policy sets none).
        self.level_max_rows = [min(priorities.policy(index).max_queue_rows or max_rows, max_rows)
                               for index in range(priorities.levels)]
        super().__init__()
        # The batch thread waits on this while a batch fills: _put wakes it only once the
        # requests or rows it waits for have arrived. Waking it for every arrival would cost
        # each request a thread switch and a GIL hand-off on the path between two predict calls.
        self.enough_arrived = threading.Condition(self.mutex)

    # -- put() and get(), without what this queue does not use -----------------------------
    # Queue's own take the not_full condition, count unfinished_tasks for join(), and notify
    # not_empty on every put, which walks its waiters; here a put wakes the batch thread
    # only where it waits in get(), once: under load it is busy, and nobody waits there.

    def put(self, item: Pending, block: bool = True, timeout: float | None = None) -> None:
        with self.mutex:
            self._put(item)
            if self._getting:
                self._getting = False
                self.not_empty.notify()

    def get(self, block: bool = True, timeout: float | None = None) -> Iterable[Pending]:
        if not block or timeout is not None:
            return super().get(block, timeout)
        with self.mutex:
            while not self._qsize():
                self._getting = True
                self.not_empty.wait()
            self._getting = False
            return self._get()

    # -- queue.Queue's extension points (called with the mutex held) ---------------------

    def _init(self, maxsize: int) -> None:
        levels = range(self.priorities.levels)
        self._arrivals: list[collections.deque[Pending]] = [collections.deque() for _ in levels]
        self._arrival_requests = 0
        self._arrival_rows = 0
        self._backlogs: list[collections.deque[Pending]] = [collections.deque() for _ in levels]
        # One level reads its backlog as it is; several read as one, highest first.
        self._backlog: Iterable[Pending] = self._backlogs[0] if len(levels) == 1 else _Backlog(self._backlogs)
        self.queued_rows = 0
        self.level_rows = [0 for _ in levels]
        self.closed = False
        self.broken: BaseException | None = None
        # While a batch fills: the arrivals (requests, rows) that wake the batch thread.
        self._wake: tuple[int, int] | None = None
        # True while the batch thread waits in get() for a first arrival.
        self._getting = False
        # The clock's reading at the last flush(): a batch whose oldest request came before it waits no more.
        self.flushed_at = float("-inf")

    def _qsize(self) -> int:
        return self._arrival_requests + sum(map(len, self._backlogs)) + self.closed

    def _put(self, pending: Pending) -> None:
        level = pending.level
        if self.broken is not None:
            raise BatcherBroken(f"model '{self.name}' cannot serve: its batch thread died")
        if self.closed:
            self._observer.rejected("shutting_down")
            raise ShuttingDown("the server is shutting down")
        if self.queued_rows + pending.rows > self.max_rows:
            self._observer.rejected("queue_full")
            raise QueueFull(
                f"model '{self.name}' is overloaded: {self.queued_rows} rows are waiting "
                f"and at most {self.max_rows} may (MAX_QUEUE_ROWS); retry later"
            )
        if self.level_rows[level] + pending.rows > self.level_max_rows[level]:
            self._observer.rejected("queue_full")
            self._observer.level_rejected(level + 1)
            raise QueueFull(
                f"model '{self.name}' is overloaded at priority level {level + 1}: {self.level_rows[level]} rows "
                f"of that level are waiting and at most {self.level_max_rows[level]} may; retry later"
            )
        pending.counted = pending.rows
        self.queued_rows += pending.rows
        self.level_rows[level] += pending.rows
        self._observer.queue_depth(self.queued_rows)
        if self.priorities.levels > 1:
            self._observer.level_depth(level + 1, self.level_rows[level])
        self._arrivals[level].append(pending)
        self._arrival_requests += 1
        self._arrival_rows += pending.rows
        if self._wake is not None and (self._arrival_requests >= self._wake[0] or self._arrival_rows >= self._wake[1]):
            self.enough_arrived.notify()

    def _get(self) -> Iterable[Pending]:
        # Into the backlog first, then out of the arrivals.
        for arrivals, backlog in zip(self._arrivals, self._backlogs, strict=True):
            if arrivals:
                backlog.extend(arrivals)
                arrivals.clear()
        self._arrival_requests = 0
        self._arrival_rows = 0
        return self._backlog

    # -- the batch thread -------------------------------------------------------------

    @property
    def wake_requests(self) -> int | None:
        """While a batch fills, the arrivals that wake its thread (fewer rows may fill it); else None."""
        return None if self._wake is None else self._wake[0]

    def wait_for_arrivals(self, *, requests: int, rows: int, until: float, clock: Callable[[], float],
                          oldest: float = float("inf")) -> Iterable[Pending] | None:
        """Wait until `requests` requests or `rows` rows arrived, the clock reads `until`, the
        queue closes, or a flush() comes after `oldest` (the batch's oldest request came); then
        get() the backlog, or None if nothing arrived."""
        with self.mutex:
            self._wake = (requests, rows)
            try:
                while (self._arrival_requests < requests and self._arrival_rows < rows and not self.closed
                       and self.flushed_at < oldest):
                    remaining = until - clock()
                    if remaining <= 0 or not self.enough_arrived.wait(remaining):
                        break
            finally:
                self._wake = None
            if not self._arrival_requests:
                return None
            return self._get()

    def waiting(self) -> int:
        """Requests queued and not finished taking (the batch thread's view; arrivals read unlocked)."""
        return self._arrival_requests + sum(1 for pending in self._backlog if pending.remaining)

    def forget_done(self) -> None:
        """Drop answered requests from the backlog; only they leave it."""
        # One look at each future: one cancelled between two looks would leave unnotified.
        # Each level's deque is kept in place (filtered, not replaced): the backlog reads them.
        for backlog in self._backlogs:
            for _ in range(len(backlog)):
                pending = backlog.popleft()
                if not pending.done():
                    backlog.append(pending)
                elif not pending.started:
                    pending.notify_if_cancelled()

    def unfinished(self) -> list[Pending]:
        with self.mutex:
            return [*self._backlog, *itertools.chain.from_iterable(self._arrivals)]

    # -- any thread -------------------------------------------------------------------

    def release(self, releases: Iterable[tuple[Pending, int]]) -> None:
        """Stop counting rows of requests, each row once; the gauge hears of it once per call."""
        with self.mutex:
            released = 0
            level_rows = self.level_rows
            for pending, rows in releases:
                rows = min(rows, pending.counted)
                pending.counted -= rows
                released += rows
                level_rows[pending.level] -= rows
            if released:
                self.queued_rows -= released
                self._observer.queue_depth(self.queued_rows)
                if self.priorities.levels > 1:
                    for index, rows in enumerate(level_rows):
                        self._observer.level_depth(index + 1, rows)

    def uncount(self, pending: Pending) -> None:
        """Stop counting whatever rows of a request still count (its future is done)."""
        # Lock-free when nothing is left: counted only falls, and an answered request's rows
        # were released when its predict call started.
        if pending.counted:
            self.release([(pending, pending.counted)])

    def flush(self, now: float) -> None:
        """Requests queued before `now` wait for company no more: the batch forming goes at once.
        With `now` at infinity, no batch ever waits again."""
        with self.mutex:
            self.flushed_at = max(self.flushed_at, now)
            self.enough_arrived.notify_all()

    def close(self, *, broken: BaseException | None = None) -> None:
        """Refuse every later put(), and wake the batch thread wherever it waits."""
        with self.mutex:
            self.closed = True
            if broken is not None:
                self.broken = broken
            self.not_empty.notify_all()
            self.enough_arrived.notify_all()
