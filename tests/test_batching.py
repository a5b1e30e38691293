"""Unit tests of the batching engine, driven by a fake predictor gated by events.

The first request of a test often holds the model (its call blocks on an event) while
the next ones queue up, so what the following batch holds is decided, not timed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from app.batching import Batcher, BatchObserver, bucket_sizes
from app.errors import (
    BadRequest,
    BatcherBroken,
    DeadlineExceeded,
    InvalidInput,
    PayloadTooLarge,
    PredictFailed,
    QueueFull,
    ShuttingDown,
)

WAIT_S = 10  # upper bound for events that should come at once; never reached when passing


class FakeModel:
    """Records every batch it is called with; y = 10 * x, so rows are traceable."""

    def __init__(self, poison: float | None = None) -> None:
        self.calls: list[dict[str, np.ndarray]] = []
        self.poison = poison
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
        return {"y": x * 10}

    @property
    def batch_rows(self) -> list[int]:
        return [len(call["x"]) for call in self.calls]


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
    future = batcher.submit(rows(-1.0))
    assert started.wait(WAIT_S)
    return future, release


def test_bucket_sizes_are_powers_of_two_up_to_max():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(32) == (1, 2, 4, 8, 16, 32)
    assert bucket_sizes(48) == (1, 2, 4, 8, 16, 32, 48)


def test_single_request_gets_its_own_rows(make_batcher, fake):
    batcher = make_batcher()
    result = batcher.submit(rows(1.0, 2.0, 3.0)).result(WAIT_S)
    np.testing.assert_array_equal(result.outputs["y"], rows(10.0, 20.0, 30.0)["x"])
    assert (result.batch_rows, result.batch_requests) == (3, 1)


def test_requests_queued_while_model_busy_share_one_batch(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(rows(float(i))) for i in range(1, 6)]
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
    futures = [batcher.submit(rows(float(i))) for i in range(10)]
    release.set()
    results = [future.result(WAIT_S) for future in [first, *futures]]
    assert [r.batch_rows for r in results] == [1] + [4] * 8 + [2] * 2
    assert fake.batch_rows == [1, 4, 4, 2]
    assert [r.outputs["y"][0, 0] for r in results[1:]] == [10.0 * i for i in range(10)]


def test_large_request_is_split_and_rejoined_in_order(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4)
    values = [float(v) for v in range(10)]
    result = batcher.submit(rows(*values)).result(WAIT_S)
    np.testing.assert_array_equal(result.outputs["y"], rows(*values)["x"] * 10)
    assert fake.batch_rows == [4, 4, 2]


def test_split_request_shares_its_last_batch_with_the_next_request(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4)
    first, release = occupy(batcher, fake)
    big = batcher.submit(rows(*[float(v) for v in range(6)]))
    small = batcher.submit(rows(100.0))
    release.set()
    assert big.result(WAIT_S).outputs["y"][:, 0].tolist() == [0, 10, 20, 30, 40, 50]
    assert small.result(WAIT_S).outputs["y"][0, 0] == 1000.0
    assert fake.batch_rows == [1, 4, 4]
    assert fake.calls[2]["x"][:3, 0].tolist() == [4.0, 5.0, 100.0]


def test_only_same_shape_requests_share_a_batch_oldest_group_first(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8)
    first, release = occupy(batcher, fake)
    wide_a = batcher.submit(rows(1.0, width=3))
    narrow_b = batcher.submit(rows(2.0, width=2))
    wide_c = batcher.submit(rows(3.0, width=3))
    narrow_d = batcher.submit(rows(4.0, width=2))
    release.set()
    for future, value, width in [(wide_a, 10, 3), (narrow_b, 20, 2), (wide_c, 30, 3), (narrow_d, 40, 2)]:
        np.testing.assert_array_equal(future.result(WAIT_S).outputs["y"], [[value] * width])
    # The batch after the held one takes the oldest group (3 wide), then the 2-wide group.
    assert [call["x"].shape for call in fake.calls[1:]] == [(2, 3), (2, 2)]
    assert fake.calls[1]["x"][:, 0].tolist() == [1.0, 3.0]


def test_dtype_difference_keeps_requests_apart(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    as_float = batcher.submit({"x": np.ones((1, 2), np.float32)})
    as_double = batcher.submit({"x": np.ones((1, 2), np.float64)})
    release.set()
    assert as_float.result(WAIT_S).outputs["y"].dtype == np.float32
    assert as_double.result(WAIT_S).outputs["y"].dtype == np.float64
    assert fake.batch_rows == [1, 1, 1]


def test_batch_timeout_waits_for_more_until_the_oldest_has_waited(make_batcher, fake):
    batcher = make_batcher(max_batch_size=3, batch_timeout_ms=60_000)
    futures = [batcher.submit(rows(float(i))) for i in range(3)]
    # A full batch goes at once: the 60 s timeout would fail this bound.
    results = [future.result(WAIT_S) for future in futures]
    assert [r.batch_requests for r in results] == [3, 3, 3]
    assert fake.batch_rows == [3]


def test_batch_timeout_dispatches_a_partial_batch_after_the_timeout(make_batcher, fake):
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=50)
    started_at = batcher._clock()
    result = batcher.submit(rows(1.0)).result(WAIT_S)
    assert result.batch_requests == 1
    assert batcher._clock() - started_at >= 0.05


def test_expired_batch_window_still_takes_everything_queued(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(max_batch_size=8, batch_timeout_ms=20, clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(rows(float(i))) for i in range(5)]
    now[0] += 10.0  # every queued request has waited its window out behind the held batch
    release.set()
    assert [future.result(WAIT_S).batch_requests for future in futures] == [5] * 5
    assert fake.batch_rows == [1, 8]


def test_zero_timeout_dispatches_without_waiting_for_a_full_batch(make_batcher, fake):
    batcher = make_batcher(max_batch_size=64, batch_timeout_ms=0)
    assert batcher.submit(rows(1.0)).result(WAIT_S).batch_rows == 1


def test_exception_fails_only_its_batch(make_batcher):
    model = FakeModel(poison=666.0)
    batcher = make_batcher(predict_fn=model, bisect_failures=False)
    first, release = occupy(batcher, model)
    poisoned = batcher.submit(rows(666.0))
    neighbour = batcher.submit(rows(2.0))
    release.set()
    assert first.result(WAIT_S).outputs["y"][0, 0] == -10.0
    for future in (poisoned, neighbour):
        with pytest.raises(PredictFailed, match="ValueError: poisoned value 666"):
            future.result(WAIT_S)
    # The loop goes on.
    assert batcher.submit(rows(3.0)).result(WAIT_S).outputs["y"][0, 0] == 30.0
    assert batcher.alive


def test_bisect_fails_only_the_poisoned_request(make_batcher):
    model = FakeModel(poison=666.0)
    batcher = make_batcher(predict_fn=model)
    first, release = occupy(batcher, model)
    futures = [batcher.submit(rows(v)) for v in (1.0, 2.0, 666.0, 4.0, 5.0)]
    release.set()
    for future, value in zip(futures, (1.0, 2.0, None, 4.0, 5.0)):
        if value is None:
            with pytest.raises(PredictFailed, match="poisoned"):
                future.result(WAIT_S)
        else:
            assert future.result(WAIT_S).outputs["y"][0, 0] == value * 10


def test_wrong_number_of_output_rows_fails_the_batch(make_batcher):
    batcher = make_batcher(predict_fn=lambda batch: {"y": batch["x"][:1]}, max_batch_size=4)
    with pytest.raises(BadRequest, match="one row per input row"):
        batcher.submit(rows(1.0, 2.0)).result(WAIT_S)


def test_request_still_queued_at_its_deadline_is_dropped_unrun(make_batcher, fake):
    now = [1000.0]
    batcher = make_batcher(clock=lambda: now[0])
    first, release = occupy(batcher, fake)
    late = batcher.submit(rows(7.0), timeout_s=1.0)
    on_time = batcher.submit(rows(8.0), timeout_s=100.0)
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
        batcher.predict(rows(7.0), timeout_s=0.05)
    release.set()
    first.result(WAIT_S)
    assert batcher.submit(rows(8.0)).result(WAIT_S).outputs["y"][0, 0] == 80.0
    assert all(7.0 not in call["x"] for call in fake.calls)


def test_request_expiring_while_its_batch_forms_is_left_out(make_batcher, fake):
    batcher = make_batcher(max_batch_size=4, batch_timeout_ms=60_000)
    with pytest.raises(DeadlineExceeded):
        batcher.predict(rows(7.0), timeout_s=0.05)
    # Three more rows fill the batch of four, which then goes without the expired one.
    result = batcher.submit(rows(1.0, 2.0, 3.0)).result(WAIT_S)
    assert result.batch_requests == 1
    assert fake.batch_rows == [4]
    assert fake.calls[0]["x"][:, 0].tolist() == [1.0, 2.0, 3.0, 3.0]


def test_cancelled_request_is_skipped(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    cancelled = batcher.submit(rows(7.0))
    assert cancelled.cancel()
    kept = batcher.submit(rows(8.0))
    release.set()
    assert kept.result(WAIT_S).batch_requests == 1
    assert all(7.0 not in call["x"] for call in fake.calls)
    assert batcher.queued_rows == 0


def test_full_queue_rejects_at_once_with_retry_after(make_batcher, fake):
    batcher = make_batcher(max_queue_rows=3)
    first, release = occupy(batcher, fake)
    accepted = [batcher.submit(rows(1.0, 2.0)), batcher.submit(rows(3.0))]
    with pytest.raises(QueueFull) as rejected:
        batcher.submit(rows(4.0))
    assert rejected.value.status_code == 503
    assert rejected.value.headers == {"Retry-After": "1"}
    release.set()
    assert [f.result(WAIT_S).outputs["y"][:, 0].tolist() for f in accepted] == [[10.0, 20.0], [30.0]]
    # Once the queue drained, the same request is accepted.
    assert batcher.submit(rows(4.0)).result(WAIT_S).outputs["y"][0, 0] == 40.0


def test_request_larger_than_the_queue_is_refused_as_too_large(make_batcher):
    batcher = make_batcher(max_queue_rows=2)
    with pytest.raises(PayloadTooLarge, match="at most 2 rows"):
        batcher.submit(rows(1.0, 2.0, 3.0))


@pytest.mark.parametrize(
    "inputs",
    [{"x": np.zeros((0, 2))}, {"x": np.zeros((2, 2)), "z": np.zeros((3, 2))}, {"x": np.float32(1.0)}],
    ids=["no rows", "uneven inputs", "scalar"],
)
def test_malformed_inputs_are_refused(make_batcher, inputs):
    with pytest.raises(InvalidInput):
        make_batcher().submit(inputs)


def test_several_inputs_travel_together(make_batcher):
    def add(batch):
        return {"sum": batch["a"] + batch["b"], "a": batch["a"]}

    batcher = make_batcher(predict_fn=add)
    result = batcher.submit({"a": np.array([[1.0], [2.0]]), "b": np.array([[10.0], [20.0]])}).result(WAIT_S)
    assert result.outputs["sum"].tolist() == [[11.0], [22.0]]
    assert result.outputs["a"].tolist() == [[1.0], [2.0]]


def test_batching_off_runs_each_request_alone(make_batcher, fake):
    batcher = make_batcher(batching=False)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(rows(float(i))) for i in range(3)]
    release.set()
    assert [f.result(WAIT_S).batch_requests for f in futures] == [1, 1, 1]
    assert fake.batch_rows == [1, 1, 1, 1]


def test_close_drains_every_accepted_request(make_batcher, fake):
    batcher = make_batcher(max_batch_size=2)
    first, release = occupy(batcher, fake)
    futures = [batcher.submit(rows(float(i))) for i in range(5)]
    batcher.close(drain=True, timeout_s=0)
    with pytest.raises(ShuttingDown):
        batcher.submit(rows(99.0))
    release.set()
    batcher.close(timeout_s=WAIT_S)
    assert [f.result(0).outputs["y"][0, 0] for f in futures] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert not batcher.alive


def test_close_without_drain_fails_what_is_queued(make_batcher, fake):
    batcher = make_batcher()
    first, release = occupy(batcher, fake)
    queued = batcher.submit(rows(1.0))
    batcher.close(drain=False, timeout_s=0)
    release.set()
    batcher.close(timeout_s=WAIT_S)
    assert first.result(0).outputs["y"][0, 0] == -10.0
    with pytest.raises(ShuttingDown):
        queued.result(0)


class Fatal(BaseException):
    """Stands for what no `except Exception` catches (e.g. an interpreter-level error)."""


def test_thread_death_fails_pending_and_later_requests_at_once(make_batcher, fake):
    started, release = fake.hold()

    def dying(batch):
        fake(batch)
        raise Fatal("boom")

    batcher = make_batcher(predict_fn=dying)
    running = batcher.submit(rows(1.0))
    assert started.wait(WAIT_S)
    queued = batcher.submit(rows(2.0))
    release.set()
    for future in (running, queued):
        with pytest.raises(BatcherBroken, match="batch thread died"):
            future.result(WAIT_S)
    batcher._thread.join(WAIT_S)
    assert not batcher.alive
    with pytest.raises(BatcherBroken):
        batcher.submit(rows(3.0))


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
    futures = [batcher.submit(rows(1.0, 2.0)), batcher.submit(rows(3.0))]
    with pytest.raises(QueueFull):
        batcher.submit(rows(4.0))
    release.set()
    for future in futures:
        future.result(WAIT_S)
    assert observer.batches == [(1, 1, 0), (3, 2, 1)]
    assert observer.rejections == ["queue_full"]
    assert max(observer.depths) == 3 and observer.depths[-1] == 0
