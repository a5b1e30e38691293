"""The fill policy, by plain calls: no thread, no queue, the clock's reading passed in.

With max_batch_size 8 a quarter of a batch is 3 requests (FILL_UNDER_LOAD_MIN_REQUESTS).
"""

from __future__ import annotations

import math

import pytest

from app.core.batching import CallStats, FillPolicy, FillWait
from app.core.batching.fill import FILL_RETURN_S_PER_REQUEST


def after(*, requests: int, waiting: int, predict_s: float = 0.5, ended_at: float = 0.0,
          max_batch_size: int = 8, **knobs) -> FillPolicy:
    policy = FillPolicy(max_batch_size=max_batch_size, **knobs)
    policy.record(CallStats(requests=requests, predict_s=predict_s, ended_at=ended_at, waiting=waiting))
    return policy


def test_before_any_call_a_batch_goes_at_once():
    assert FillPolicy(max_batch_size=8).decide(oldest_enqueued_at=5.0, now=5.0) is None


def test_a_fixed_timeout_waits_from_the_oldest_request_for_a_full_batch():
    policy = after(requests=8, waiting=8, batch_timeout_s=0.02)
    assert policy.decide(oldest_enqueued_at=10.0, now=10.5) == FillWait(until=10.02, requests=8)


def test_at_light_load_a_batch_goes_at_once():
    # One answered, one waited through the call: two in all, below a quarter of a batch.
    assert after(requests=1, waiting=1).decide(oldest_enqueued_at=0.1, now=0.6) is None


def test_requests_that_waited_through_the_last_call_make_the_next_batch_wait_to_be_full():
    policy = after(requests=1, waiting=2, predict_s=0.5)
    assert policy.decide(oldest_enqueued_at=0.2, now=0.75) == FillWait(until=1.25, requests=8)


def test_a_large_call_nobody_waited_through_makes_no_batch_wait_long_after_it():
    # Four answered (a quarter of a batch and more), none waiting: a burst that has ended.
    assert after(requests=4, waiting=0, predict_s=0.5).decide(oldest_enqueued_at=60.0, now=60.0) is None


def test_the_first_request_back_after_a_large_call_waits_for_as_many_as_were_around_it():
    policy = after(requests=4, waiting=0, predict_s=0.5)
    assert policy.decide(oldest_enqueued_at=0.01, now=0.25) == FillWait(until=0.75, requests=4)
    # Those that waited through the call are expected too, not a full batch.
    policy = after(requests=4, waiting=2, predict_s=0.5)
    assert policy.decide(oldest_enqueued_at=0.01, now=0.25) == FillWait(until=0.75, requests=6)


def test_soon_after_means_within_the_calls_time_and_a_margin_per_request_it_answered():
    soon_s = 0.5 + 4 * FILL_RETURN_S_PER_REQUEST
    policy = after(requests=4, waiting=0, predict_s=0.5, ended_at=0.0)
    assert policy.decide(oldest_enqueued_at=soon_s, now=1.0) == FillWait(until=1.5, requests=4)
    # A request later than that follows a burst that has ended: it goes at once.
    assert policy.decide(oldest_enqueued_at=math.nextafter(soon_s, math.inf), now=1.0) is None


def test_a_call_below_a_quarter_of_a_batch_is_not_a_loop_coming_back():
    # 32-row batches: a quarter is 8 requests; 7 answered, none waiting.
    assert after(requests=7, waiting=0, max_batch_size=32).decide(oldest_enqueued_at=0.0, now=0.0) is None
    assert after(requests=8, waiting=0, max_batch_size=32).decide(oldest_enqueued_at=0.0, now=0.0) == FillWait(
        until=0.5, requests=8)


@pytest.mark.parametrize("requests, waiting", [(4, 0), (1, 2)], ids=["loop coming back", "load rising"])
def test_fill_under_load_off_never_waits(requests, waiting):
    assert after(requests=requests, waiting=waiting, fill_under_load=False).decide(
        oldest_enqueued_at=0.0, now=0.0) is None


def test_each_call_replaces_what_the_policy_knew():
    policy = after(requests=4, waiting=0)
    policy.record(CallStats(requests=1, predict_s=0.5, ended_at=1.0, waiting=0))
    assert policy.decide(oldest_enqueued_at=1.0, now=1.0) is None
