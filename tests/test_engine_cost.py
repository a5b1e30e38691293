"""What a request leaves behind in the engine, asserted as behaviour, not as timing.

The engine's cost per request is measured by hand (CPU and instructions per request of a
Batcher fed by many threads); what can be asserted is its shape: an answered request is
freed by reference counting alone, with no garbage for the cyclic collector to find.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np

from app.core.batching import Batcher
from app.core.call import Call

WAIT_S = 10  # upper bound for answers that should come at once; never reached when passing


def test_an_answered_request_is_freed_without_the_cyclic_collector() -> None:
    batcher = Batcher(lambda batch: {"y": batch["x"] * 10}, name="m", max_batch_size=4)
    gc.disable()
    try:
        first = batcher.submit(Call(), {"x": np.ones((1, 2), np.float32)})
        assert first.result(WAIT_S).outputs["y"].tolist() == [[10.0, 10.0]]
        freed = weakref.ref(first)
        del first
        # The batch thread holds its last batch until it takes the next: one more request moves it on.
        second = batcher.submit(Call(), {"x": np.full((1, 2), 2.0, np.float32)})
        assert second.result(WAIT_S).outputs["y"].tolist() == [[20.0, 20.0]]
        assert freed() is None
    finally:
        gc.enable()
        batcher.close()
