"""The frozen heap (app/runtime.py): start-up's objects out of the collector's full passes,
and a retired model version's objects collected all the same."""

from __future__ import annotations

import gc
import weakref

from app import runtime


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
