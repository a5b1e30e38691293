"""The engine's face: what the registry and the request layer may ask of a batcher.

`Batcher` (this package, the default mode) and `RemoteBatcher` (app/model_process/client.py,
a batcher living in a model process) both implement `Engine`; nothing above the engine
reaches past it. Their fixed limits and knobs are one `EngineInfo`, which a model process
sends its workers as it is.

A caller submits a call's rows and waits for them within the call's deadline: `wait` on a
thread, `awaited` on an asyncio loop, each the engine's `give_up` once the deadline passed.
This is the server's one deadline wait, whichever engine and whichever caller.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Protocol

from app.core.batching.rows import Tensors
from app.core.batching.work import BatchResult
from app.core.call import Call


@dataclasses.dataclass(frozen=True, slots=True)
class EngineInfo:
    """A batcher's name, limits and knobs, as /readyz and the request limits read them."""

    name: str
    max_request_rows: int
    max_batch_size: int
    batch_timeout_s: float
    fill_under_load: bool
    # One request per call as sent: a signature with no batch dimension.
    whole: bool
    # Variable-length padding is on for this signature.
    padded: bool

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Engine(Protocol):
    """One signature's batcher, local or in a model process."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def alive(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    @property
    def queued_rows(self) -> int: ...

    @property
    def batches_run(self) -> int: ...

    def submit(self, call: Call, inputs: Tensors) -> concurrent.futures.Future[BatchResult]:
        """Queue the call's rows; the future holds the answer, a ServingError, or is cancelled
        (the call's client_gone said so before the rows ran)."""
        ...

    def give_up(self, future: concurrent.futures.Future[BatchResult], call: Call, waited_s: float | None,
                ) -> BatchResult:
        """The call's deadline passed with `future` pending: DeadlineExceeded, or the answer that
        landed meanwhile."""
        ...

    def flush(self, *, later_too: bool = False) -> None:
        """Run what is queued now without waiting out its window (a stopping worker's or process's)."""
        ...

    def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None: ...


def wait(engine: Engine, call: Call, future: concurrent.futures.Future[BatchResult], *,
         now: float | None = None) -> BatchResult:
    """The answer of `future` (the engine's `submit`) within the call's deadline, waited for on
    this thread (`now`: the time on the clock the deadline was set by, where that is not
    time.monotonic's, as a batcher's own in its tests)."""
    left_s = call.seconds_left(now)
    wait_s = None if left_s is None else max(left_s, 0.0)
    try:
        return future.result(timeout=wait_s)
    except concurrent.futures.TimeoutError:
        return engine.give_up(future, call, wait_s)


async def awaited(engine: Engine, call: Call, future: concurrent.futures.Future[BatchResult]) -> BatchResult:
    """`wait` for a caller on an asyncio loop (the gRPC server): the same deadline, awaited
    without holding a thread."""
    left_s = call.seconds_left()
    if not future.done():
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        # The engine answers on its own thread: one wake-up of the loop per call.
        future.add_done_callback(lambda _future: _wake_from_thread(loop, woken))
        timer = None if left_s is None else loop.call_later(max(left_s, 0.0), _wake, woken)
        try:
            await woken
        finally:
            if timer is not None:
                timer.cancel()
    if future.done():
        return future.result()
    return engine.give_up(future, call, None if left_s is None else max(left_s, 0.0))


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _wake_from_thread(loop: asyncio.AbstractEventLoop, woken: asyncio.Future[None]) -> None:
    try:
        loop.call_soon_threadsafe(_wake, woken)
    except RuntimeError:
        pass  # the loop closed (its server stopped): nobody awaits the answer
