"""Chunked prefill end to end: prompts far longer than the largest prefill bucket (1,500-2,031
tokens with buckets of at most 256, on tiny models with a 2,048 context) give greedy tokens
identical to transformers (fp32), with and without prefix caching, for Llama and the
sliding-window layers of Gemma-2, Gemma-3 and Mistral on the native path, and for Llama and
Gemma-3 on XLA; and nothing compiles after warm-up."""
import pytest

from tests.common import greedy_tokens, hf_greedy, mixed_prompts
from tpu_executor import LLM

NEW_TOKENS = 16
MAX_MODEL_LEN = 2048
# Buckets far below the context: every long prompt runs as several chunks.
OPTIONS = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=256, prefill_buckets=(64, 256),
               decode_buckets=(2, 4), decode_context_buckets=(512,), cache_dir=None, show_progress=False,
               strict=True, memory_budget_bytes=256 << 20)


def long_prompts():
    """The longest prompt the context allows, long and short ones (random ids)."""
    longest = mixed_prompts(2, 1500, MAX_MODEL_LEN - NEW_TOKENS - 1, vocab=500, seed=3)
    return longest + mixed_prompts(3, 20, 900, vocab=500, seed=4)


_references = {}


def reference(path, prompts):
    if path not in _references:
        _references[path] = hf_greedy(path, prompts, NEW_TOKENS)[0]
    return _references[path]


# Sliding windows (Gemma-2, Gemma-3, Mistral: 32 tokens) far shorter than the chunks, each with
# and without prefix caching on the native path. On XLA (about a minute a case; the heavy tier,
# as test_engine's XLA cases chunk prompts at a 96-token budget) Llama with and without it.
XLA_CASES = [("llama", True), ("llama", False)]
CASES = [(arch, "cpu", caching) for arch in ("llama", "gemma2", "gemma3", "mistral") for caching in (True, False)]
CASES += [(arch, "xla", caching) for arch, caching in XLA_CASES]


@pytest.mark.parametrize("arch,device,prefix_caching", [
    pytest.param(*case, marks=pytest.mark.slow) if case[1] == "xla" else case for case in CASES])
def test_chunked_prompts_match_transformers(checkpoints, arch, device, prefix_caching):
    prompts = long_prompts()
    expected = reference(checkpoints[arch], prompts)
    assert all(len(set(t)) > 4 for t in expected)  # a degenerate model would prove nothing
    llm = LLM(model=checkpoints[arch], device=device, enable_prefix_caching=prefix_caching, **OPTIONS)
    assert greedy_tokens(llm, prompts, NEW_TOKENS) == expected
    # Again: with prefix caching the prompts now start from cached blocks deep in their context.
    assert greedy_tokens(llm, prompts, NEW_TOKENS) == expected
    stats = llm.stats()
    assert stats.graphs_compiled_after_warmup == 0
    assert (stats.prefix_cache_hits > 0.4 * stats.prefix_cache_queries) == prefix_caching


def test_running_requests_get_a_token_every_step_while_a_long_prompt_prefills(checkpoints):
    from tests.common import engine_with_worker
    from tpu_executor import SamplingParams
    from tpu_executor.worker.worker import Worker

    options = dict(OPTIONS, device="cpu", max_num_batched_tokens=128, async_scheduling=False)
    engine = engine_with_worker(checkpoints["llama"], Worker, **options)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(mixed_prompts(2, 10, 20, vocab=500)):
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"run{i}")
    engine.step()  # both prefill and get their first token
    engine.add_request({"prompt_token_ids": mixed_prompts(2, 1000, 1000, vocab=500)[0]},
                       SamplingParams(temperature=0, max_tokens=1), request_id="long")
    steps = 0
    while True:
        advanced = {delta.request_id for delta in engine.step()}
        steps += 1
        assert {"run0", "run1"} <= advanced  # the running requests never wait
        if "long" in advanced:
            break
    assert steps == -(-1000 // (128 - 2))  # 126 prompt tokens a step next to the two decodes
    engine.shutdown()
