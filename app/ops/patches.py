"""Changes to the frameworks' own behaviour, each measured on one pinned version.

Each patch overrides a private detail of Flask, Gunicorn, logging or prometheus_client (the
HTTP transport's own in app/http/patches.py) that a new release may
change or make unneeded. `MEASURED_ON` names the version each was measured on, and
tests/test_patches.py fails when the installed or pinned version differs: then re-measure the patch
(docs/performance.md says how) and either move the pin here or drop the patch.

- `batched_writes` (logging): access lines reach each plain StreamHandler's stream in a
  few large writes instead of one write and flush per line (app/ops/logs.py's access writer).
- `value_of`, `HistogramCounts` (prometheus_client): the metrics a request or a batch updates
  write their values directly, as the metric's own `inc`/`observe` would after checks that a
  child made once has passed; a histogram finds its bucket by bisection, not a walk.

Imports nothing of TensorFlow: Gunicorn's master loads the worker class.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import logging
import select
from collections.abc import Iterator
from typing import Any

MEASURED_ON = {"flask": "3.1.3", "gunicorn": "27.0.1", "prometheus-client": "0.26.0", "python": "3.11"}


@contextlib.contextmanager
def batched_writes(logger: logging.Logger) -> Iterator[None]:
    """Records handled inside reach each plain stream handler's stream in a few large writes.

    A StreamHandler writes and flushes every record: a system call per access line, each one
    handing the GIL to another thread under load. Each handler's lock is held meanwhile, so
    lines from other threads wait and stay in order; filters and formatters run as ever.
    Only handlers of exactly StreamHandler's class: a subclass (a rotating file, pytest's
    live log) may size, rotate or decorate its stream, and keeps its own way.
    """
    swapped: list[tuple[logging.StreamHandler, Any, io.StringIO]] = []
    try:
        for handler in dict.fromkeys(_handlers_of(logger)):  # a handler reached twice is swapped once
            if type(handler) is not logging.StreamHandler or handler.stream is None:
                continue
            handler.acquire()
            buffer = io.StringIO()
            # Not setStream(): that flushes the old stream, a system call for nothing.
            swapped.append((handler, handler.stream, buffer))
            handler.stream = buffer
        yield
    finally:
        for handler, stream, buffer in swapped:
            try:
                handler.stream = stream
                _write_whole_lines(stream, buffer.getvalue())
            except Exception:
                handler.handleError(logging.makeLogRecord({"msg": "access lines", "levelno": logging.INFO}))
            finally:
                handler.release()


def _write_whole_lines(stream: Any, text: str) -> None:
    """Write `text` in pieces of whole lines, each at most PIPE_BUF bytes where a line allows.

    Every worker writes to the same stderr pipe: a write of up to PIPE_BUF bytes reaches it
    whole, a longer one may be interleaved with another process's lines when the pipe is full.
    """
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        length = len(line.encode()) if not line.isascii() else len(line)
        if piece and size + length > select.PIPE_BUF:
            _write_and_flush(stream, "".join(piece))
            piece, size = [], 0
        piece.append(line)
        size += length
    if piece:
        _write_and_flush(stream, "".join(piece))


def _write_and_flush(stream: Any, text: str) -> None:
    stream.write(text)
    if hasattr(stream, "flush"):
        stream.flush()


def _handlers_of(logger: logging.Logger) -> list[logging.Handler]:
    """The handlers a record of `logger` reaches, as Logger.callHandlers walks them."""
    found: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        found.extend(current.handlers)
        current = current.parent if current.propagate else None
    return found


def value_of(metric: Any) -> Any:
    """The value object of a Counter or Gauge without labels, or of one labelled child.

    Its `inc(amount)` is what the metric's own inc() ends in (a lock and, under Gunicorn, a
    write to the worker's mmap file), less the check that the label set is complete, done once
    when the child was made. For a Counter the caller's amounts must never be negative.
    """
    return metric._value


class HistogramCounts:
    """One labelled child of a Histogram: `observe` writes what Histogram.observe writes.

    The sum, and the count of the first bucket whose upper bound is at least the amount, found
    by bisection rather than by a walk from the smallest bound; NaN, as there, counts in no bucket.
    """

    __slots__ = ("_sum", "_buckets", "_bounds")

    def __init__(self, child: Any) -> None:
        self._sum = child._sum
        self._buckets = child._buckets
        self._bounds = list(child._upper_bounds)  # ends with +Inf: every number finds a bucket

    def observe(self, amount: float) -> None:
        self._sum.inc(amount)
        index = bisect.bisect_left(self._bounds, amount)
        if amount <= self._bounds[index]:  # False for NaN only
            self._buckets[index].inc(1)

