"""Unit tests of the batching engine, driven by a fake predictor gated by events.

The first request of a test often holds the model (its call blocks on an event) while
the next ones queue up, so what the following batch holds is decided, not timed.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from app.core.batching import Batcher, BatchObserver, awaited, bucket_sizes, max_predict_calls
from app.core.call import Call
from app.core.errors import (
    BadRequest,
    BatcherBroken,
    DeadlineExceeded,
    InvalidInput,
    PayloadTooLarge,
    PredictFailed,
    QueueFull,
    ShuttingDown,
)
from tests.conftest import REPO, wait_for

WAIT_S = 10  # upper bound for events that should come at once; never reached when passing


class FakeModel:
    """Records every batch it is called with; y = 10 * x, so rows are traceable."""

    def __init__(self, poison: float | None = None, output=lambda x: x * 10) -> None:
        self.calls: list[dict[str, np.ndarray]] = []
        self.poison = poison
        self.output = output
        self._hold: tuple[threading.Event, threading.Event] | None = None

    def hold(self) -> tuple[threading.Event, threading.Event]:
        """The next call signals `started` and then waits for `release`."""
        self._hold = (threading.Event(), threading.Event())
        return self._hold

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append({name: value.copy() for name, value in batch.items()})
        if self._hold is not None:
            started, release = self._hold
            self._hold = None
            started.set()
            assert release.wait(WAIT_S)
        x = batch["x"]
        if self.poison is not None and (x == self.poison).any():
            raise ValueError(f"poisoned value {self.poison}")
        return {"y": self.output(x)}

    @property
    def batch_rows(self) -> list[int]:
        return [len(call["x"]) for call in self.calls]


class Fatal(BaseException):
    """Stands for what no `except Exception` catches (e.g. an interpreter-level error)."""


def rows(*values: float, width: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.array([[v] * width for v in values], dtype=np.float32)}


@pytest.fixture
def fake() -> FakeModel:
    return FakeModel()


@pytest.fixture
def make_batcher(fake):
    batchers: list[Batcher] = []

    def make(**kwargs) -> Batcher:
        batcher = Batcher(kwargs.pop("predict_fn", fake), **kwargs)
        batchers.append(batcher)
        return batcher

    yield make
    for batcher in batchers:
        batcher.close(drain=False, timeout_s=WAIT_S)


def occupy(batcher: Batcher, fake: FakeModel):
    """Submit one request whose predict call blocks; returns (its future, release event)."""
    started, release = fake.hold()
    future = batcher.submit(Call(), rows(-1.0))
    assert started.wait(WAIT_S)
    return future, release


def test_the_engine_imports_neither_tensorflow_nor_flask():
    """The predict function is injected: the engine runs, and is tested, without either."""
    imported = set()
    for path in (REPO / "app" / "core" / "batching").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert "numpy" in imported and "queue" in imported
    assert not imported & {"tensorflow", "keras", "flask", "werkzeug"}


def test_bucket_sizes_are_powers_of_two_up_to_max():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)


def test_single_request_gets_its_own_rows(make_batcher, fake):
    batcher = make_batcher()
    result = batcher.submit(Call(), rows(1.0, 2.0, 3.0)).result(WAIT_S)
    np.testing.assert_array_equal(result.outputs["y"], rows(10.0, 20.0, 30.0)["x"])
    assert (result.batch_rows, result.batch_requests) == (3, 1)


def test_requests_queued_while_model_busy_share_one_batch(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(1, 6)]
    release.set()
    first.result(WAIT_S)
    results = [future.result(WAIT_S) for future in futures]
    for i, result in enumerate(results, start=1):
        np.testing.assert_array_equal(result.outputs["y"], rows(10.0 * i)["x"])
        assert (result.batch_rows, result.batch_requests) == (5, 5)
    # 5 rows padded to the next bucket, 8, by repeating the last row.
    assert fake.batch_rows == [1, 8]
    np.testing.assert_array_equal(fake.calls[1]["x"][:, 0], [1, 2, 3, 4, 5, 5, 5, 5])


def test_batch_never_exceeds_max_batch_size(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(10)]
    release.set()
    results = [future.result(WAIT_S) for future in [first, *futures]]
    assert [r.batch_rows for r in results] == [1] + [4] * 8 + [2] * 2
    assert fake.batch_rows == [1, 4, 4, 2]
    assert [r.outputs["y"][0, 0] for r in results[1:]] == [10.0 * i for i in range(10)]


def test_large_request_is_split_and_rejoined_in_order(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4)
    values = [float(v) for v in range(10)]
    result = batcher.submit(Call(), rows(*values)).result(WAIT_S)
    np.testing.assert_array_equal(result.outputs["y"], rows(*values)["x"] * 10)
    assert fake.batch_rows == [4, 4, 2]


def test_split_request_shares_its_last_batch_with_the_next_request(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4)
    first, release = occupy(batcher, fake)
    big = batcher.submit(Call(), rows(*[float(v) for v in range(6)]))
    small = batcher.submit(Call(), rows(100.0))
    release.set()
    assert big.result(WAIT_S).outputs["y"][:, 0].tolist() == [0, 10, 20, 30, 40, 50]
    assert small.result(WAIT_S).outputs["y"][0, 0] == 1000.0
    assert fake.batch_rows == [1, 4, 4]
    assert fake.calls[2]["x"][:3, 0].tolist() == [4.0, 5.0, 100.0]


def test_only_same_shape_requests_share_a_batch_oldest_group_first(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8)
    first, release = occupy(batcher, fake)
    wide_a = batcher.submit(Call(), rows(1.0, width=3))
    narrow_b = batcher.submit(Call(), rows(2.0, width=2))
    wide_c = batcher.submit(Call(), rows(3.0, width=3))
    narrow_d = batcher.submit(Call(), rows(4.0, width=2))
    release.set()
    for future, value, width in [(wide_a, 10, 3), (narrow_b, 20, 2), (wide_c, 30, 3), (narrow_d, 40, 2)]:
        np.testing.assert_array_equal(future.result(WAIT_S).outputs["y"], [[value] * width])
    # The batch after the held one takes the oldest group (3 wide), then the 2-wide group.
    assert [call["x"].shape for call in fake.calls[1:]] == [(2, 3), (2, 2)]
    assert fake.calls[1]["x"][:, 0].tolist() == [1.0, 3.0]


def test_dtype_difference_keeps_requests_apart(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    as_float = batcher.submit(Call(), {"x": np.ones((1, 2), np.float32)})
    as_double = batcher.submit(Call(), {"x": np.ones((1, 2), np.float64)})
    release.set()
    assert as_float.result(WAIT_S).outputs["y"].dtype == np.float32
    assert as_double.result(WAIT_S).outputs["y"].dtype == np.float64
    assert fake.batch_rows == [1, 1, 1]


def test_batch_timeout_waits_for_more_until_the_oldest_has_waited(make_batcher, fake):
    batcher = make_batcher(max_batch_size=3, batch_timeout_ms=60_000)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(3)]
    # A full batch goes at once: the 60 s timeout would fail this bound.
    results = [future.result(WAIT_S) for future in futures]
    assert [r.batch_requests for r in results] == [3, 3, 3]
    assert fake.batch_rows == [3]


def test_batch_timeout_dispatches_a_partial_batch_after_the_timeout(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=50, clock=time.monotonic)
    started_at = time.monotonic()
    result = batcher.submit(Call(), rows(1.0)).result(WAIT_S)
    assert result.batch_requests == 1
    assert time.monotonic() - started_at >= 0.05


def test_expired_batch_window_still_takes_everything_queued(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=20, clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(5)]
    now[0] += 10.0  # every queued request has waited its window out behind the held batch
    release.set()
    assert [future.result(WAIT_S).batch_requests for future in futures] == [5] * 5
    assert fake.batch_rows == [1, 8]


def test_zero_timeout_dispatches_without_waiting_for_a_full_batch(make_batcher, fake):
    batcher = make_batcher(max_batch_size=64, batch_timeout_ms=0)
    assert batcher.submit(Call(), rows(1.0)).result(WAIT_S).batch_rows == 1


def test_exception_fails_only_its_batch(make_batcher):
    model = FakeModel(poison=666.0)
    batcher = make_batcher(predict_fn=model, bisect_failures=False)
    first, release = occupy(batcher, model)
    poisoned = batcher.submit(Call(), rows(666.0))
    neighbour = batcher.submit(Call(), rows(2.0))
    release.set()
    assert first.result(WAIT_S).outputs["y"][0, 0] == -10.0
    for future in (poisoned, neighbour):
        with pytest.raises(PredictFailed, match="ValueError: poisoned value 666"):
            future.result(WAIT_S)
    # The loop goes on.
    assert batcher.submit(Call(), rows(3.0)).result(WAIT_S).outputs["y"][0, 0] == 30.0
    assert batcher.alive


def test_bisect_fails_only_the_poisoned_request(make_batcher):
    model = FakeModel(poison=666.0)
    batcher = make_batcher(predict_fn=model)
    first, release = occupy(batcher, model)
    futures = [batcher.submit(Call(), rows(v)) for v in (1.0, 2.0, 666.0, 4.0, 5.0)]
    release.set()
    for future, value in zip(futures, (1.0, 2.0, None, 4.0, 5.0), strict=True):
        if value is None:
            with pytest.raises(PredictFailed, match="poisoned"):
                future.result(WAIT_S)
        else:
            assert future.result(WAIT_S).outputs["y"][0, 0] == value * 10


def test_wrong_number_of_output_rows_fails_the_batch(make_batcher):
    batcher = make_batcher(predict_fn=lambda batch: {"y": batch["x"][:1]}, max_batch_size=4)
    with pytest.raises(BadRequest, match="one row per input row"):
        batcher.submit(Call(), rows(1.0, 2.0)).result(WAIT_S)


def test_request_still_queued_at_its_deadline_is_dropped_unrun(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    late = batcher.submit(Call(deadline=now[0] + 1.0), rows(7.0))
    on_time = batcher.submit(Call(deadline=now[0] + 100.0), rows(8.0))
    now[0] += 5.0
    release.set()
    with pytest.raises(DeadlineExceeded):
        late.result(WAIT_S)
    assert on_time.result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert all(7.0 not in call["x"] for call in fake.calls)


def test_predict_answers_deadline_exceeded_and_the_request_never_runs(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    with pytest.raises(DeadlineExceeded):
        batcher.predict(Call.within(0.05), rows(7.0))
    release.set()
    first.result(WAIT_S)
    assert batcher.submit(Call(), rows(8.0)).result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert all(7.0 not in call["x"] for call in fake.calls)


def test_request_expiring_while_its_batch_forms_is_left_out(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4, batch_timeout_ms=60_000)
    with pytest.raises(DeadlineExceeded):
        batcher.predict(Call.within(0.05), rows(7.0))
    # Three more rows fill the batch of four, which then goes without the expired one.
    result = batcher.submit(Call(), rows(1.0, 2.0, 3.0)).result(WAIT_S)
    assert result.batch_requests == 1
    assert fake.batch_rows == [4]
    assert fake.calls[0]["x"][:, 0].tolist() == [1.0, 2.0, 3.0, 3.0]


def test_cancelled_request_is_skipped(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    cancelled = batcher.submit(Call(), rows(7.0))
    assert cancelled.cancel()
    kept = batcher.submit(Call(), rows(8.0))
    release.set()
    assert kept.result(WAIT_S).batch_requests == 1
    assert all(7.0 not in call["x"] for call in fake.calls)
    assert batcher.queued_rows == 0
    # concurrent.futures.wait() counts a cancelled future as done only once it was notified.
    assert cancelled in concurrent.futures.wait([cancelled], WAIT_S).done


def test_cancelled_request_the_thread_never_reached_is_notified_to_waiters(make_batcher, fake):
    batcher = make_batcher(max_batch_size=1)
    first, release = occupy(batcher, fake)
    taken = batcher.submit(Call(), rows(1.0))
    cancelled = batcher.submit(Call(), rows(2.0))
    assert cancelled.cancel()
    release.set()
    taken.result(WAIT_S)  # its batch was full before the cancelled request was looked at
    assert cancelled in concurrent.futures.wait([cancelled], WAIT_S).done
    assert fake.batch_rows == [1, 1]


def test_full_queue_rejects_at_once_with_retry_after(make_batcher, fake):
    batcher = make_batcher(max_queue_rows=3)
    first, release = occupy(batcher, fake)
    accepted = [batcher.submit(Call(), rows(1.0, 2.0)), batcher.submit(Call(), rows(3.0))]
    with pytest.raises(QueueFull) as rejected:
        batcher.submit(Call(), rows(4.0))
    assert rejected.value.status_code == 503
    assert rejected.value.headers == {"Retry-After": "1"}
    release.set()
    assert [f.result(WAIT_S).outputs["y"][:, 0].tolist() for f in accepted] == [[10.0, 20.0], [30.0]]
    # Once the queue drained, the same request is accepted.
    assert batcher.submit(Call(), rows(4.0)).result(WAIT_S).outputs["y"][0, 0] == 40.0


def test_request_larger_than_the_queue_is_refused_as_too_large(make_batcher):
    batcher = make_batcher(max_queue_rows=2)
    with pytest.raises(PayloadTooLarge, match="at most 2 rows"):
        batcher.submit(Call(), rows(1.0, 2.0, 3.0))


@pytest.mark.parametrize(
    "inputs",
    [{"x": np.zeros((0, 2))}, {"x": np.zeros((2, 2)), "z": np.zeros((3, 2))}, {"x": np.float32(1.0)}],
    ids=["no rows", "uneven inputs", "scalar"],
)
def test_malformed_inputs_are_refused(make_batcher, inputs):
    with pytest.raises(InvalidInput):
        make_batcher().submit(Call(), inputs)


def test_several_inputs_travel_together(make_batcher):
    def add(batch):
        return {"sum": batch["a"] + batch["b"], "a": batch["a"]}

    batcher = make_batcher(predict_fn=add)
    result = batcher.submit(Call(), {"a": np.array([[1.0], [2.0]]), "b": np.array([[10.0], [20.0]])}).result(WAIT_S)
    assert result.outputs["sum"].tolist() == [[11.0], [22.0]]
    assert result.outputs["a"].tolist() == [[1.0], [2.0]]


def test_batching_off_runs_each_request_alone(make_batcher, fake):
    batcher = make_batcher(batching=False)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(3)]
    release.set()
    assert [f.result(WAIT_S).batch_requests for f in futures] == [1, 1, 1]
    assert fake.batch_rows == [1, 1, 1, 1]


def test_whole_mode_runs_each_request_as_sent_and_answers_what_the_model_returned(make_batcher, fake):
    """An unbatchable signature: 5 rows over max_batch_size 2 are neither split nor padded to
    a bucket, scalars and empty inputs pass, and a scalar output is no 'wrong row count'."""
    seen = []

    def total(batch):
        seen.append({name: value.copy() for name, value in batch.items()})
        return {"sum": np.float32(sum(float(value.sum()) for value in batch.values())), "n": np.int64(len(seen))}

    batcher = make_batcher(predict_fn=total, whole=True, max_batch_size=2)
    odd_rows = {"x": np.arange(5, dtype=np.float32)}
    answers = [batcher.submit(Call(), inputs).result(WAIT_S) for inputs in (odd_rows, {"x": np.float32(4.0)}, {})]
    assert [a.outputs["sum"].tolist() for a in answers] == [10.0, 4.0, 0.0]
    assert [a.outputs["sum"].shape for a in answers] == [(), (), ()]
    assert [(a.batch_rows, a.batch_requests) for a in answers] == [(1, 1)] * 3
    assert [call["x"].shape for call in seen[:2]] == [(5,), ()]
    assert seen[2] == {}


def test_whole_mode_never_joins_requests_and_counts_each_as_one_queued_row(make_batcher, fake):
    batcher = make_batcher(whole=True, max_queue_rows=3)
    first, release = occupy(batcher, fake)
    queued = [batcher.submit(Call(), rows(1.0, 2.0, 3.0)), batcher.submit(Call(), rows(4.0, 5.0, 6.0))]
    assert batcher.queued_rows == 2  # six rows, two requests: a whole request is one item
    release.set()
    assert [f.result(WAIT_S).outputs["y"][:, 0].tolist() for f in queued] == [[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]]
    assert fake.batch_rows == [1, 3, 3]


def test_close_drains_every_accepted_request(make_batcher, fake):
    batcher = make_batcher(max_batch_size=2)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(5)]
    batcher.close(drain=True, timeout_s=0)
    with pytest.raises(ShuttingDown):
        batcher.submit(Call(), rows(99.0))
    release.set()
    batcher.close(timeout_s=WAIT_S)
    assert [f.result(0).outputs["y"][0, 0] for f in futures] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert not batcher.alive


def test_close_without_drain_fails_what_is_queued(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    queued = batcher.submit(Call(), rows(1.0))
    cancelled = batcher.submit(Call(), rows(2.0))
    assert cancelled.cancel()
    batcher.close(drain=False, timeout_s=0)
    release.set()
    batcher.close(timeout_s=WAIT_S)
    assert first.result(0).outputs["y"][0, 0] == -10.0
    with pytest.raises(ShuttingDown):
        queued.result(0)
    assert cancelled in concurrent.futures.wait([cancelled], 0).done


def test_thread_death_fails_pending_and_later_requests_at_once(make_batcher, fake):
    started, release = fake.hold()

    def dying(batch):
        fake(batch)
        raise Fatal("boom")

    batcher = make_batcher(predict_fn=dying)
    running = batcher.submit(Call(), rows(1.0))
    assert started.wait(WAIT_S)
    queued = batcher.submit(Call(), rows(2.0))
    release.set()
    for future in (running, queued):
        with pytest.raises(BatcherBroken, match="batch thread died"):
            future.result(WAIT_S)
    batcher.join(WAIT_S)
    assert not batcher.alive
    with pytest.raises(BatcherBroken):
        batcher.submit(Call(), rows(3.0))


class RecordingObserver(BatchObserver):
    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []
        self.rejections: list[str] = []
        self.depths: list[int] = []

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        self.batches.append((rows, requests, padded_rows))

    def rejected(self, reason: str) -> None:
        self.rejections.append(reason)

    def queue_depth(self, rows: int) -> None:
        self.depths.append(rows)


def test_observer_sees_batches_padding_depth_and_rejections(make_batcher, fake):
    observer = RecordingObserver()
    batcher = make_batcher(observer=observer, max_queue_rows=3)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(1.0, 2.0)), batcher.submit(Call(), rows(3.0))]
    with pytest.raises(QueueFull):
        batcher.submit(Call(), rows(4.0))
    release.set()
    for future in futures:
        future.result(WAIT_S)
    assert observer.batches == [(1, 1, 0), (3, 2, 1)]
    assert observer.rejections == ["queue_full"]
    assert max(observer.depths) == 3 and observer.depths[-1] == 0


# -- nothing the thread calls besides predict strands a request (issue: items 1 and 2) --------

class FailingObserver(BatchObserver):
    """Every hook raises, as a broken metrics client would."""

    def queue_depth(self, rows: int) -> None:
        raise RuntimeError("queue_depth hook failed")

    def queue_wait(self, seconds: float) -> None:
        raise RuntimeError("queue_wait hook failed")

    def batch_done(self, *, rows: int, requests: int, padded_rows: int, predict_s: float) -> None:
        raise RuntimeError("batch_done hook failed")

    def rejected(self, reason: str) -> None:
        raise RuntimeError("rejected hook failed")


def test_failing_observer_hooks_are_logged_once_and_every_request_is_answered(make_batcher, fake, caplog):
    now = [1000.0]
    batcher = make_batcher(observer=FailingObserver(), max_queue_rows=4, clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i))) for i in range(1, 4)]
    expiring = batcher.submit(Call(deadline=now[0] + 1.0), rows(9.0))
    with pytest.raises(QueueFull):  # the rejected hook raised, the caller still gets its 503
        batcher.submit(Call(), rows(5.0))
    now[0] += 5.0
    release.set()
    assert first.result(WAIT_S).outputs["y"][0, 0] == -10.0
    assert [f.result(WAIT_S).outputs["y"][0, 0] for f in futures] == [10.0, 20.0, 30.0]
    with pytest.raises(DeadlineExceeded):
        expiring.result(WAIT_S)
    assert batcher.alive and batcher.queued_rows == 0
    assert batcher.submit(Call(), rows(4.0)).result(WAIT_S).outputs["y"][0, 0] == 40.0
    failed = sorted(r.getMessage().split()[2] for r in caplog.records if "observer hook" in r.getMessage())
    assert failed == ["batch_done", "queue_depth", "queue_wait", "rejected"]


class DyingObserver(BatchObserver):
    """Its queue_wait raises Fatal on the given call: the thread dies while a batch is being formed."""

    def __init__(self, on_call: int) -> None:
        self.calls = 0
        self.on_call = on_call

    def queue_wait(self, seconds: float) -> None:
        self.calls += 1
        if self.calls == self.on_call:
            raise Fatal("observer killed the batch thread")


def test_thread_killed_while_a_batch_forms_answers_every_request_taken(make_batcher, fake):
    broken: list[tuple[Batcher, list[bool]]] = []
    futures: list[concurrent.futures.Future] = []
    batcher = make_batcher(observer=DyingObserver(on_call=3), max_batch_size=4,
                           on_broken=lambda b: broken.append((b, [f.done() for f in futures])))
    first, release = occupy(batcher, fake)
    # The next batch takes four narrow rows (its second start kills the thread), one narrow
    # request stays in the backlog for lack of room, a wide one waits for its own batch.
    futures += [batcher.submit(Call(), rows(float(i))) for i in range(5)]
    futures.append(batcher.submit(Call(), rows(7.0, width=3)))
    release.set()
    first.result(WAIT_S)
    for future in futures:
        with pytest.raises(BatcherBroken, match="batch thread died"):
            future.result(WAIT_S)
    assert fake.batch_rows == [1]
    assert broken == [(batcher, [True] * 6)]  # called once, after every request was answered
    assert batcher.broken and not batcher.alive
    assert batcher.queued_rows == 0


def test_output_that_cannot_be_rejoined_fails_only_its_request(make_batcher):
    # A model whose output width follows the batch: the two parts of a split request do not join.
    model = FakeModel(output=lambda x: np.repeat(x[:, :1] * 10, len(x), axis=1))
    batcher = make_batcher(predict_fn=model, max_batch_size=4)
    first, release = occupy(batcher, model)
    split = batcher.submit(Call(), rows(1.0, 2.0, 3.0, 4.0, 5.0))
    neighbour = batcher.submit(Call(), rows(6.0))
    release.set()
    with pytest.raises(PredictFailed, match="do not join"):
        split.result(WAIT_S)
    # The neighbour shared the split request's last batch (2 rows) and gets its own row of it.
    assert neighbour.result(WAIT_S).outputs["y"].tolist() == [[60.0, 60.0]]
    assert model.batch_rows == [1, 4, 2]
    assert batcher.alive
    assert batcher.submit(Call(), rows(7.0)).result(WAIT_S).outputs["y"].tolist() == [[70.0]]


def test_thread_death_calls_on_broken_once_and_liveness_says_so(make_batcher, fake):
    calls: list[Batcher] = []

    def dying(batch):
        raise Fatal("boom")

    batcher = make_batcher(predict_fn=dying, on_broken=calls.append)
    assert not batcher.broken
    with pytest.raises(BatcherBroken):
        batcher.submit(Call(), rows(1.0)).result(WAIT_S)
    batcher.join(WAIT_S)
    assert calls == [batcher] and batcher.broken


def test_a_closed_batcher_is_not_broken(make_batcher):
    batcher = make_batcher()
    batcher.close(timeout_s=WAIT_S)
    assert not batcher.alive and not batcher.broken


# -- races (item 4) --------------------------------------------------------------------------

class LockCheckingObserver(BatchObserver):
    """Records each queue depth and whether the row queue's mutex was held while it was reported."""

    def __init__(self) -> None:
        self.batcher: Batcher | None = None
        self.depths: list[tuple[int, bool]] = []

    def queue_depth(self, rows: int) -> None:
        lock = self.batcher.queue.mutex
        free = lock.acquire(blocking=False)
        if free:
            lock.release()
        self.depths.append((rows, not free))


def test_queue_depth_is_reported_under_the_lock_and_ends_at_zero(make_batcher, fake):
    # Reported outside the lock, a submit's "1" could land after the batch thread's "0": the
    # gauge would show a queue on an idle server. While the model is held, the test's own
    # thread is the only one near the lock, so a report made outside it is seen as such.
    observer = LockCheckingObserver()
    batcher = make_batcher(observer=observer)
    observer.batcher = batcher
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(), rows(float(i), float(i))) for i in range(3)]
    release.set()
    for future in [first, *futures]:
        future.result(WAIT_S)
    assert all(held for _, held in observer.depths), observer.depths
    assert [rows for rows, _ in observer.depths][:5] == [1, 0, 2, 4, 6]
    assert observer.depths[-1] == (0, True) and batcher.queued_rows == 0


def test_close_without_drain_stops_a_drain_that_timed_out(make_batcher, fake):
    batcher = make_batcher(max_batch_size=1)
    first, release = occupy(batcher, fake)
    queued = [batcher.submit(Call(), rows(float(i))) for i in range(3)]
    batcher.close(drain=True, timeout_s=0)  # the drain times out: the model is still held
    batcher.close(drain=False, timeout_s=0)  # escalate: what is not running yet fails now
    release.set()
    batcher.close(timeout_s=WAIT_S)
    assert first.result(0).outputs["y"][0, 0] == -10.0
    for future in queued:
        with pytest.raises(ShuttingDown):
            future.result(0)
    assert fake.batch_rows == [1]
    assert batcher.queued_rows == 0


def test_predict_keeps_an_answer_that_lands_just_after_its_timeout(make_batcher, fake):
    batcher = make_batcher(clock=lambda: 1000.0)  # the batch thread never sees the deadline pass
    first, release = occupy(batcher, fake)
    submit = batcher.submit

    def submit_answered_late(call, inputs):
        future = submit(call, inputs)
        cancel = future.cancel

        def cancel_after_the_answer():
            # predict() timed out and is about to give up: the answer lands right now.
            release.set()
            concurrent.futures.wait([future], WAIT_S)
            return cancel()

        future.cancel = cancel_after_the_answer
        return future

    batcher.submit = submit_answered_late
    result = batcher.predict(Call(deadline=1000.0 + 0.01), rows(7.0))
    assert result.outputs["y"][0, 0] == 70.0
    first.result(WAIT_S)


def test_predict_timing_out_on_a_running_request_answers_504_and_discards_the_result(make_batcher, fake):
    observer = RecordingObserver()
    batcher = make_batcher(observer=observer, clock=lambda: 1000.0)
    started, release = fake.hold()
    with pytest.raises(DeadlineExceeded):
        batcher.predict(Call(deadline=1000.0 + 0.01), rows(7.0))  # the predict call started and is held
    assert started.is_set()
    release.set()
    assert batcher.submit(Call(), rows(8.0)).result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert observer.rejections == ["deadline"]


def test_awaited_answers_on_the_loop_with_the_rows_own_results(make_batcher, fake):
    batcher = make_batcher()
    call = Call.within(WAIT_S)
    result = asyncio.run(awaited(batcher, call, batcher.submit(call, rows(3.0, 4.0))))
    assert result.outputs["y"][:, 0].tolist() == [30.0, 40.0]


def test_awaited_gives_up_at_the_deadline_and_the_rows_never_run(make_batcher, fake):
    observer = RecordingObserver()
    batcher = make_batcher(observer=observer)
    first, release = occupy(batcher, fake)
    call = Call.within(0.05)
    with pytest.raises(DeadlineExceeded):
        asyncio.run(awaited(batcher, call, batcher.submit(call, rows(7.0))))
    release.set()
    first.result(WAIT_S)
    assert batcher.submit(Call(), rows(8.0)).result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert all(7.0 not in call["x"] for call in fake.calls)
    assert observer.rejections == ["deadline"]


def test_an_awaiting_caller_cancelled_leaves_its_rows_to_the_engine(make_batcher, fake):
    """The caller's task is cancelled (its client left): the rows stay queued and answered, so
    the servable that holds them (registry.submit) is left when they are, not before."""
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    future = batcher.submit(Call(), rows(5.0))

    async def cancelled_while_waiting() -> None:
        waiting = asyncio.ensure_future(awaited(batcher, Call(), future))
        await asyncio.sleep(0)  # one turn of the loop: the task starts and awaits the rows
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(cancelled_while_waiting())
    assert not future.done()
    release.set()
    assert future.result(WAIT_S).outputs["y"][0, 0] == 50.0
    first.result(WAIT_S)


# -- fairness and retry bounds (item 5) -----------------------------------------------------

def test_request_over_max_request_rows_is_refused_while_the_queue_has_room(make_batcher, fake):
    batcher = make_batcher(max_queue_rows=16, max_request_rows=4)
    with pytest.raises(PayloadTooLarge, match="at most 4 rows per request"):
        batcher.submit(Call(), rows(*range(5)))
    first, release = occupy(batcher, fake)
    accepted = [batcher.submit(Call(), rows(*range(4))) for _ in range(4)]  # 16 rows fill the queue
    assert batcher.queued_rows == 16
    release.set()
    assert [f.result(WAIT_S).outputs["y"][:, 0].tolist() for f in accepted] == [[0, 10, 20, 30]] * 4


def test_max_request_rows_defaults_to_and_is_capped_by_the_queue(make_batcher):
    assert make_batcher(max_queue_rows=8).max_request_rows == 8
    assert make_batcher(max_queue_rows=8, max_request_rows=100).max_request_rows == 8


def test_bisection_stops_at_the_requests_deadline(make_batcher, fake):
    now = [1000.0]

    def failing_slowly(batch):
        result = fake(batch)
        if len(fake.calls) == 1:
            return result  # occupy's call
        now[0] += 10.0  # each call outlasts every deadline below
        raise ValueError("model always fails")

    batcher = make_batcher(predict_fn=failing_slowly, clock=lambda: now[0], max_batch_size=8)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(Call(deadline=now[0] + 5.0), rows(float(i))) for i in range(8)]
    release.set()
    first.result(WAIT_S)
    for future in futures:
        with pytest.raises(DeadlineExceeded):
            future.result(WAIT_S)
    assert fake.batch_rows == [1, 8]  # one failed call of all eight, no bisection past the deadline


def test_always_failing_model_makes_a_bounded_number_of_predict_calls(make_batcher):
    model = FakeModel(poison=0.0)
    batcher = make_batcher(predict_fn=model, max_batch_size=32)
    first, release = occupy(batcher, model)
    futures = [batcher.submit(Call(), rows(0.0)) for _ in range(32)]
    release.set()
    for future in futures:
        with pytest.raises(PredictFailed, match="poisoned"):
            future.result(WAIT_S)
    assert max_predict_calls(32) == 21
    assert len(model.calls) == 1 + 21  # not 1 + 63, one call per node of the whole bisection tree


def test_two_poisoned_requests_in_a_full_batch_fail_alone_within_the_budget(make_batcher):
    model = FakeModel(poison=666.0)
    batcher = make_batcher(predict_fn=model, max_batch_size=32)
    first, release = occupy(batcher, model)
    values = [666.0 if i in (3, 29) else float(i) for i in range(32)]
    futures = [batcher.submit(Call(), rows(v)) for v in values]
    release.set()
    for future, value in zip(futures, values, strict=True):
        if value == 666.0:
            with pytest.raises(PredictFailed, match="poisoned"):
                future.result(WAIT_S)
        else:
            assert future.result(WAIT_S).outputs["y"][0, 0] == value * 10
    assert len(model.calls) - 1 <= max_predict_calls(32)


def test_cancelled_and_timed_out_rows_stop_counting_at_once(make_batcher, fake):
    batcher = make_batcher(max_queue_rows=4)
    first, release = occupy(batcher, fake)
    cancelled = batcher.submit(Call(), rows(1.0, 2.0, 3.0))
    with pytest.raises(QueueFull):
        batcher.submit(Call(), rows(4.0, 5.0))
    assert cancelled.cancel()
    assert batcher.queued_rows == 0  # the model is still held: the thread has not seen it
    with pytest.raises(DeadlineExceeded):
        batcher.predict(Call.within(0.01), rows(6.0, 7.0, 8.0, 9.0))
    assert batcher.queued_rows == 0
    accepted = batcher.submit(Call(), rows(4.0, 5.0))
    assert batcher.queued_rows == 2
    release.set()
    assert accepted.result(WAIT_S).outputs["y"][:, 0].tolist() == [40.0, 50.0]
    assert batcher.queued_rows == 0
    assert fake.batch_rows == [1, 2]


# -- filling batches under load (BATCH_FILL_UNDER_LOAD) ------------------------------------

def held_for(batcher: Batcher, fake: FakeModel, now: list[float], *, seconds: float, waiting: int):
    """A predict call that 'takes' `seconds` of the fake clock while `waiting` requests queue behind it."""
    first, release = occupy(batcher, fake)
    queued = [batcher.submit(Call(), rows(float(index))) for index in range(waiting)]
    now[0] += seconds
    release.set()
    assert first.result(WAIT_S).batch_requests == 1
    return queued


def answered_call(batcher: Batcher, fake: FakeModel, now: list[float], *, requests: int, seconds: float,
                  during: int = 0):
    """A predict call of `requests` requests that 'takes' `seconds` of the fake clock while `during`
    more arrive; returns (the answered futures, the arrivals), after the call has answered."""
    first, release_first = occupy(batcher, fake)
    answered = [batcher.submit(Call(), rows(float(index))) for index in range(requests)]
    started, release = fake.hold()
    release_first.set()
    assert started.wait(WAIT_S)
    now[0] += seconds
    arrived = [batcher.submit(Call(), rows(float(index))) for index in range(requests, requests + during)]
    release.set()
    assert [future.result(WAIT_S).batch_requests for future in answered] == [requests] * requests
    return answered, arrived


def test_under_load_a_batch_waits_for_more_rows_instead_of_going_half_empty(make_batcher, fake):
    now = [1000.0]  # frozen after the held call: only more rows can end the wait
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    queued = held_for(batcher, fake, now, seconds=60.0, waiting=2)
    # Two requests waited through a 60 s call: the batch they start may wait up to 60 s to fill.
    # Dispatching at once would have run them as a batch of 2 by now.
    assert not queued[0].done() and not wait_for_done(queued[0], within_s=0.3)
    queued += [batcher.submit(Call(), rows(float(index))) for index in range(2, 8)]
    results = [future.result(WAIT_S) for future in queued]
    assert [(result.batch_rows, result.batch_requests) for result in results] == [(8, 8)] * 8
    assert [result.outputs["y"][0, 0] for result in results] == [10.0 * index for index in range(8)]


def test_at_light_load_a_request_goes_at_once_whatever_the_last_call_took(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    (alone,) = held_for(batcher, fake, now, seconds=60.0, waiting=1)
    # One request waited through a call that answered one: two in all, below a quarter of a
    # batch (at least 3): moderate load, not the model falling behind; no wait.
    assert alone.result(WAIT_S).batch_requests == 1


def test_a_straggler_waits_for_the_clients_the_last_call_just_answered(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    _, (straggler,) = answered_call(batcher, fake, now, requests=6, seconds=60.0, during=1)
    # One waited, six were just answered: a closed loop's clients come straight back, so the
    # straggler waits for them rather than take a whole call alone.
    assert not wait_for_done(straggler, within_s=0.3)
    returning = [batcher.submit(Call(), rows(float(index))) for index in range(7, 13)]
    # ... and goes with them: seven clients were seen around that call, and a batch of eight
    # would wait for one that is not coming (the fake clock is frozen: the window never ends).
    assert [future.result(WAIT_S).batch_requests for future in [straggler, *returning]] == [7] * 7
    assert [future.result(WAIT_S).outputs["y"][0, 0] for future in returning] == [10.0 * i for i in range(7, 13)]


def test_after_a_large_call_the_first_request_back_waits_for_the_others(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    # Four requests, a quarter of a batch or more; nobody arrived during their call.
    answered_call(batcher, fake, now, requests=4, seconds=60.0)
    # A closed loop's clients are all in the call, so none waits through it; the first one
    # back still waits for the other three rather than take a call alone.
    back = [batcher.submit(Call(), rows(4.0))]
    assert not wait_for_done(back[0], within_s=0.3)
    back += [batcher.submit(Call(), rows(float(index))) for index in range(5, 8)]
    assert [future.result(WAIT_S).batch_requests for future in back] == [4] * 4
    assert [future.result(WAIT_S).outputs["y"][0, 0] for future in back] == [40.0, 50.0, 60.0, 70.0]


def test_a_request_long_after_a_large_call_goes_at_once(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    answered_call(batcher, fake, now, requests=4, seconds=60.0)
    # The four were a burst, not a loop: nothing came back within the 60 s their call took.
    # A request after that is light load, and goes at once (a wait to fill would last the
    # call's 60 s, longer than the test waits).
    now[0] += 61.0
    later = batcher.submit(Call(), rows(4.0))
    assert later.result(WAIT_S).batch_requests == 1


def test_the_wait_to_fill_ends_after_as_long_as_the_last_call_took(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    queued = held_for(batcher, fake, now, seconds=0.2, waiting=3)
    now[0] += 0.2  # the fill window (0.2 s of the fake clock) has passed when the wait next looks
    results = [future.result(WAIT_S) for future in queued]
    assert [result.batch_requests for result in results] == [3, 3, 3]


def test_fill_under_load_off_dispatches_as_soon_as_the_model_is_free(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0], fill_under_load=False)
    queued = held_for(batcher, fake, now, seconds=60.0, waiting=3)
    assert [future.result(WAIT_S).batch_requests for future in queued] == [3, 3, 3]


def test_a_fixed_batch_timeout_keeps_its_own_window_under_load(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=50, clock=lambda: now[0])
    queued = held_for(batcher, fake, now, seconds=60.0, waiting=2)
    # Their window (50 ms from their arrival) closed during the 60 s call: they go at once,
    # not after another 60 s.
    assert [future.result(WAIT_S).batch_requests for future in queued] == [2, 2]


def wait_for_done(future, *, within_s: float) -> bool:
    try:
        future.result(within_s)
    except concurrent.futures.TimeoutError:
        return False
    return True


def test_a_filling_batch_wakes_its_thread_once_for_the_requests_it_waits_for(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    answered_call(batcher, fake, now, requests=4, seconds=60.0)
    back = [batcher.submit(Call(), rows(4.0))]
    # The first one back starts a batch that waits for the other three of the loop.
    assert wait_for(lambda: batcher.queue.wake_requests == 3)
    woken = []
    notify = batcher.queue.enough_arrived.notify
    batcher.queue.enough_arrived.notify = lambda *args: (woken.append(len(back)), notify(*args))
    for index in range(5, 8):
        back.append(batcher.submit(Call(), rows(float(index))))
    # Only the arrival that completes what the batch waits for wakes its thread: waking it for
    # each would cost every request a thread switch and a GIL hand-off between two calls.
    assert [future.result(WAIT_S).batch_requests for future in back] == [4] * 4
    assert [future.result(WAIT_S).outputs["y"][0, 0] for future in back] == [40.0, 50.0, 60.0, 70.0]
    assert woken == [3]  # during the third submit, with three of them already in `back`


def test_a_request_that_fills_the_waiting_batch_wakes_it_however_few_requests_came(make_batcher, fake):
    now = [1000.0]  # frozen: the fill window never ends by itself
    batcher = make_batcher(max_batch_size=8, clock=lambda: now[0])
    answered_call(batcher, fake, now, requests=4, seconds=60.0)
    first = batcher.submit(Call(), rows(4.0))
    assert wait_for(lambda: batcher.queue.wake_requests == 3)
    # Three more requests were expected; one of seven rows fills the batch on its own.
    big = batcher.submit(Call(), rows(*[float(index) for index in range(5, 12)]))
    assert [(future.result(WAIT_S).batch_rows, future.result(WAIT_S).batch_requests)
            for future in (first, big)] == [(8, 2), (8, 2)]
    assert big.result(WAIT_S).outputs["y"][:, 0].tolist() == [10.0 * index for index in range(5, 12)]


# -- a client that has gone (issue #28) ----------------------------------------------------

def test_request_whose_client_has_gone_is_dropped_unrun_and_counted(make_batcher, fake):
    observer = RecordingObserver()
    batcher = make_batcher(observer=observer)
    first, release = occupy(batcher, fake)
    gone = [False]
    left = batcher.submit(Call(client_gone=lambda: gone[0]), rows(7.0))
    stayed = batcher.submit(Call(client_gone=lambda: False), rows(8.0))
    gone[0] = True  # asked just before dispatch, not at submit
    release.set()
    assert stayed.result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert left in concurrent.futures.wait([left], WAIT_S).done and left.cancelled()
    assert all(7.0 not in call["x"] for call in fake.calls)
    assert observer.rejections == ["client_gone"]
    assert batcher.queued_rows == 0


def test_predict_for_a_client_that_has_gone_raises_cancelled(make_batcher, fake):
    batcher = make_batcher()
    with pytest.raises(concurrent.futures.CancelledError):
        batcher.predict(Call.within(WAIT_S, client_gone=lambda: True), rows(7.0))
    assert fake.calls == []


def test_client_gone_is_asked_once_before_the_first_rows_run(make_batcher, fake):
    asked = []
    batcher = make_batcher(max_batch_size=2)
    # Split over two batches: once its first rows ran, the request is finished whatever the answer.
    result = batcher.submit(Call(client_gone=lambda: asked.append(True) or len(asked) > 1), rows(1.0, 2.0, 3.0))
    assert result.result(WAIT_S).outputs["y"][:, 0].tolist() == [10.0, 20.0, 30.0]
    assert asked == [True]


def test_a_failing_client_gone_check_is_logged_once_and_the_request_served(make_batcher, fake, caplog):
    def broken_check() -> bool:
        raise RuntimeError("socket check failed")

    batcher = make_batcher()
    results = [batcher.submit(Call(client_gone=broken_check), rows(float(v))).result(WAIT_S) for v in (1, 2)]
    assert [result.outputs["y"][0, 0] for result in results] == [10.0, 20.0]
    assert [r.getMessage() for r in caplog.records] == ["client_gone of model 'default' failed (logged once)"]
    assert batcher.alive


def test_a_request_that_expires_while_its_batch_fills_is_dropped_unrun(make_batcher, fake):
    now = [1000.0]
    # A window of a minute on the fake clock: the batch waits in it until the flush below.
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=60_000, clock=lambda: now[0])
    expiring = batcher.submit(Call(deadline=now[0] + 0.01), rows(1.0))
    wait_for(lambda: batcher.queue.wake_requests is not None, within_s=WAIT_S, what="the batch filling")
    now[0] += 1.0  # past the request's deadline
    batcher.flush()
    with pytest.raises(DeadlineExceeded, match="^the request's deadline passed before it ran$"):
        expiring.result(WAIT_S)
    assert fake.calls == []


def test_an_expired_request_takes_no_room_in_the_next_batch(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=2, clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    expiring = batcher.submit(Call(deadline=now[0] + 0.01), rows(1.0))
    kept = [batcher.submit(Call(), rows(value)) for value in (2.0, 3.0)]
    now[0] += 1.0  # past the first queued request's deadline, while the model is held
    release.set()
    with pytest.raises(DeadlineExceeded, match="^the request's deadline passed before it ran$"):
        expiring.result(WAIT_S)
    assert [future.result(WAIT_S).outputs["y"][0, 0] for future in kept] == [20.0, 30.0]
    assert fake.batch_rows == [1, 2]
