"""Step time must not grow with the KV-cache size: the compiled step (torch_xla's and the JAX
path's) updates the cache in place (donated buffers). Without donation every step copies the
whole cache (0.5-0.9 s per GB on this machine), so a 1 GiB cache would be tens of times slower than a 1 MiB one.

The two engines are timed side by side, interleaved, and only a loose ratio is asserted."""
import statistics
import time

import pytest

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams

pytestmark = pytest.mark.slow  # XLA compilation, a 1 GiB cache

ONE_BUCKET_EACH = dict(prefill_buckets=(128,), decode_buckets=(8,), decode_context_buckets=(320,))
BLOCK_BYTES = 8 * 1024  # tiny Llama: 2 layers x (K, V) x 2 kv heads x 16 slots x 16 dims x fp32


def _timed_generate(llm, prompts, params):
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


@pytest.mark.parametrize("device", ["xla", "jax"])
def test_step_time_does_not_grow_with_cache_size(checkpoints, device):
    small = LLM(model=checkpoints["llama"], device=device, **tiny_engine_options(num_blocks=128, **ONE_BUCKET_EACH))
    large = LLM(model=checkpoints["llama"], device=device,
                **tiny_engine_options(num_blocks=(1 << 30) // BLOCK_BYTES, **ONE_BUCKET_EACH))
    assert large.stats().kv_cache_bytes >= 1 << 30
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (20, 40, 60, 80)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    times = {"small": [], "large": []}
    for _ in range(3):
        times["small"].append(_timed_generate(small, prompts, params))
        times["large"].append(_timed_generate(large, prompts, params))
    ratio = statistics.median(times["large"]) / statistics.median(times["small"])
    print(f"{device}: generate time, 1 GiB cache / 1 MiB cache: {ratio:.2f}")
    assert ratio < 3.0
    assert large.engine.stats().graphs_compiled_after_warmup == 0
    for llm in (small, large):
        llm.shutdown()
