"""An engine freezes its start-up heap out of the garbage collector once it is ready to serve
and gives it back when it shuts down (core/heap.py)."""
import gc

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams


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
