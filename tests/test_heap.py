"""The frozen heap (app/ops/runtime.py): start-up's objects out of the collector's full passes,
and a retired model version's objects collected all the same."""

from __future__ import annotations

import gc
import weakref

import numpy as np

from app.core import models
from app.core.batching import Batcher
from app.core.models import LoadedModel, TensorInfo
from app.core.registry import ModelRegistry, Servable
from app.ops import runtime


class _Node:
    pass


def test_unloading_a_version_collects_what_the_freeze_kept():
    cyclic = _Node()
    cyclic.itself = cyclic  # only the cyclic collector can free it, as Keras layers and tf.functions
    alive = weakref.ref(cyclic)
    runtime.freeze_heap()
    try:
        del cyclic
        gc.collect()
        assert alive() is not None  # frozen: a full collection does not reach it
        runtime.refreeze_heap()
        assert alive() is None
        assert gc.get_freeze_count() > 0  # what is left is frozen again
    finally:
        gc.unfreeze()


def test_nothing_is_frozen_where_the_heap_never_was():
    assert gc.get_freeze_count() == 0
    runtime.refreeze_heap()
    assert gc.get_freeze_count() == 0


def test_retiring_a_version_from_the_registry_frees_it_with_the_heap_frozen():
    """The registry's own call: a retired version whose objects sit in a reference cycle (as a
    Keras model's do) is freed by retire() itself, though the heap was frozen after it loaded."""
    def predict(batch):
        return {"y": batch["x"]}

    predict.itself = predict  # a cycle through the function's __dict__: only the collector frees it
    alive = weakref.ref(predict)
    spec = TensorInfo("x", (), np.dtype("float32"), "DT_FLOAT")
    model = LoadedModel("m", 1, "test", [spec], [TensorInfo("y", (), np.dtype("float32"), "DT_FLOAT")], predict)
    registry = ModelRegistry("m")
    registry.add(Servable(model, {models.DEFAULT_SIGNATURE: Batcher(predict, name="m-v1")}))
    del predict, model
    runtime.freeze_heap()
    try:
        registry.retire("m", 1)
        assert alive() is None
    finally:
        gc.unfreeze()
