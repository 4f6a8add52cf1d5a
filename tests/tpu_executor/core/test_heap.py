"""The start-up heap freeze: what start-up built is exempt from later collections, garbage of
an earlier freeze is not kept for the process's life, and an engine freezes once it is ready
and gives the heap back when it shuts down."""
import gc
import weakref

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.core.heap import freeze_startup_heap, unfreeze_heap


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


def test_engine_freezes_its_start_up_heap_and_releases_it_at_shutdown(checkpoints):
    llm = LLM(checkpoints["llama"], device="cpu", **tiny_engine_options())
    try:
        frozen = gc.get_freeze_count()
        # Torch, transformers, the model and the tokenizer: far more than the loop's objects.
        assert frozen > 10 * len(gc.get_objects())
        out = llm.generate({"prompt_token_ids": list(range(5, 30))},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()
    assert gc.get_freeze_count() == 0
