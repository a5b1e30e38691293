"""Every observer that wraps another forwards every hook the engine calls: a hook one wrapper
forgets is silently lost for every observer inside it (with tracing on, the padding metrics were;
with statistics around everything, the per-level queue metrics would have been)."""

from __future__ import annotations

import inspect

import pytest

from app.core.batching.observer import BatchObserver, GuardedObserver
from app.core.model_stats import StatsObserver
from app.ops.tracing import BatchTracer

HOOKS = sorted(name for name, member in vars(BatchObserver).items()
               if inspect.isfunction(member) and not name.startswith("_"))


@pytest.mark.parametrize("wrapper", [GuardedObserver, StatsObserver, BatchTracer], ids=lambda cls: cls.__name__)
def test_a_wrapping_observer_forwards_every_hook(wrapper):
    assert {"queue_depth", "level_depth", "length_padding", "call_answered"} <= set(HOOKS)
    assert [name for name in HOOKS if name not in vars(wrapper)] == []
