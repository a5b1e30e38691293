"""The call object: built once at the front door, carried whole to the engine and into a model process."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from app.core.batching import Batcher
from app.core.call import Call, ModelSpec
from app.core.errors import DeadlineExceeded
from app.core.registry import ModelRegistry, Servable
from app.core.serving import RequestLayer
from tests.test_serving import _exchange, _servable

WAIT_S = 10  # upper bound for answers that should come at once; never reached when passing


class _Trace:
    """A request's trace as the engine sees it: opaque, but able to give its link's fields."""

    def frame_fields(self) -> list[str | int]:
        return ["0" * 31 + "1", "0" * 15 + "2", 1]


def test_a_call_crosses_into_a_model_process_whole():
    sent = Call(ModelSpec("m", None, "stable"), "serving_default", ("y",), deadline=1234.5, priority=2,
                client_gone=lambda: False, exchange=_exchange(), trace=_Trace())
    fields = orjson.loads(orjson.dumps(sent.frame()))  # as the frame's JSON header carries it
    gone = []

    received = Call.from_frame(fields, signature="serving_default", client_gone=lambda: bool(gone),
                               trace=lambda link: ("linked", tuple(link)))

    assert received.model == ModelSpec("m", None, "stable") and received.model.pinned
    assert (received.signature, received.deadline, received.priority) == ("serving_default", 1234.5, 2)
    assert received.trace == ("linked", ("0" * 31 + "1", "0" * 15 + "2", 1))
    assert received.exchange is None and received.outputs == ()
    assert received.client_gone is not None and not received.client_gone()


def test_an_untraced_call_crosses_without_a_trace():
    fields = orjson.loads(orjson.dumps(Call(deadline=None).frame()))

    received = Call.from_frame(fields, signature="", trace=lambda link: pytest.fail("no trace was sent"))

    assert received.trace is None and received.deadline is None and not received.model.pinned


def test_the_queued_work_item_keeps_the_call_and_its_priority():
    batcher = Batcher(lambda batch: {"y": batch["x"] * 10}, name="m", max_batch_size=4)
    call = Call(priority=7, deadline=None)
    try:
        pending = batcher.submit(call, {"x": np.ones((1, 2), np.float32)})
        assert pending.result(WAIT_S).outputs["y"].tolist() == [[10.0, 10.0]]
        assert pending.call is call  # type: ignore[attr-defined]
        assert (pending.priority, pending.deadline) == (7, None)  # type: ignore[attr-defined]
    finally:
        batcher.close()


@pytest.fixture
def layer():
    registry = ModelRegistry("m")
    registry.add(_servable(1))
    layer = RequestLayer(registry, timeout_s=30, max_request_bytes=1 << 20)
    yield layer
    registry.close(drain=False)


def test_a_call_looks_its_signature_up_once(layer, monkeypatch):
    looked_up = []
    lookup = Servable.signature

    def counted(servable, name=None):
        looked_up.append(name)
        return lookup(servable, name)

    monkeypatch.setattr(Servable, "signature", counted)
    call = Call.within(layer.deadline_s(), model=ModelSpec("m"), signature="takes_floats", exchange=_exchange())

    answer = layer.infer(call, lambda _signature, _rows: {"x": np.array([[1, 2]], np.float32)})

    assert answer.outputs["y"].tolist() == [3.0]
    assert looked_up == ["takes_floats"]


def test_the_deadline_is_the_calls_own_not_one_counted_from_the_queueing(layer):
    # The deadline was set when the call was built: by the time it is queued, it has passed.
    call = Call.within(layer.deadline_s(0.0), model=ModelSpec("m"), exchange=_exchange())

    with pytest.raises(DeadlineExceeded, match="deadline passed before it was queued"):
        layer.infer(call, lambda _signature, _rows: {"x": np.ones((1, 2), np.float32)})
