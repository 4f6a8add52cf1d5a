"""The start-up heap freeze: what start-up built is exempt from later collections, and garbage
of an earlier freeze is not kept for the process's life (the engine's use of it:
tests/tpu_executor/engine/test_startup_heap.py)."""
import gc
import weakref

from tpu_executor.core.heap import YOUNG_COLLECTION_THRESHOLD, freeze_startup_heap, unfreeze_heap


class Node:
    """A container that can sit in a reference cycle (only the collector frees those)."""

    def __init__(self):
        self.other = None


def _cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_frozen_objects_are_skipped_and_a_later_freeze_frees_garbage_frozen_before():
    try:
        alive = Node()
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
        tracked = {id(obj) for obj in gc.get_objects()}
        assert id(alive) not in tracked  # frozen: no collection walks it any more
        collected_later = weakref.ref(_cycle())  # built after the freeze: collected as usual
        gc.collect()
        assert collected_later() is None

        cycle = _cycle()
        frozen_garbage = weakref.ref(cycle)
        freeze_startup_heap()  # the cycle is frozen while alive ...
        del cycle
        gc.collect()
        assert frozen_garbage() is not None  # ... so a collection cannot free it
        freeze_startup_heap()  # the next freeze (a new engine) collects it first
        assert frozen_garbage() is None
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0


def test_young_collections_are_rarer_while_frozen_and_the_thresholds_come_back():
    before = gc.get_threshold()
    try:
        freeze_startup_heap()
        freeze_startup_heap()  # a second engine: the thresholds to restore stay the first ones
        assert gc.get_threshold() == (max(before[0], YOUNG_COLLECTION_THRESHOLD), *before[1:])
    finally:
        unfreeze_heap()
    assert gc.get_threshold() == before
