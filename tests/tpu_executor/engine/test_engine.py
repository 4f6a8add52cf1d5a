"""Engine behaviour on the compiled paths (torch_xla and JAX) with a tiny Llama: zero
recompilation over 200 random requests, with and without speculative decoding, preemption that
changes nothing, n samples, seeds, stop strings, abort, prefix cache; with a token budget of
96, so that longer prompts run as chunks."""
import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.common import (
    assert_same_outputs_over_random_requests,
    logprob_values,
    output_summary,
    random_processing,
    random_requests,
    run_to_end,
    tiny_engine_options,
)
from tpu_executor import LLM, SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.tools.eagle3_head import write_random_eagle3_head

pytestmark = pytest.mark.slow  # XLA compilation


@pytest.fixture(scope="module", params=["xla", "jax"])
def llm(checkpoints, request):
    llm = LLM(model=checkpoints["llama"], device=request.param,
              **tiny_engine_options(strict=True, max_num_batched_tokens=96))
    yield llm
    llm.shutdown()


def device_of(llm) -> str:
    return llm.engine.config.device.device


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def test_zero_recompilation_over_200_random_requests(llm):
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(200):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 250))]})
        sampled = i % 3 != 0
        max_tokens = rng.randint(1, 60)
        params.append(SamplingParams(temperature=0.8 if sampled else 0, top_k=rng.choice([0, 20]),
                                     top_p=rng.choice([1.0, 0.9]), max_tokens=max_tokens,
                                     ignore_eos=True, seed=i if sampled else None,
                                     logprobs=rng.choice([None, 2]), **random_processing(rng, i, max_tokens)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    stats = llm.stats()
    assert stats.graphs_compiled_after_warmup == 0
    assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    # Warm-up noted each op's provider while tracing, and that left no guard to fail since.
    assert {"paged_attention", "prefill_attention", "rms_norm"} <= set(dict(stats.kernel_providers))


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_speculation_changes_no_output_and_compiles_nothing_after_warmup(checkpoints, llm, method, tmp_path):
    """Drafts of a draft model (the target itself: greedy drafts all hold, sampled ones by the
    rejection sampler's odds) or of a random EAGLE-3 head (over the hidden states the target's
    graphs copy out; its drafts fail), the drafters' catch-up and greedy steps in graphs of
    the plan, verified as rows of the decode graphs: 200 random requests mixing speculation
    with every sampling feature give what the engine without it gives. (N-gram drafts are made
    on the host, the same on every path; their verifies are these.)"""
    draft = checkpoints["llama"] if method == "draft_model" else \
        write_random_eagle3_head(checkpoints["llama"], str(tmp_path / "head"))
    speculative = LLM(model=checkpoints["llama"], device=device_of(llm),
                      speculative_config={"method": method, "model": draft, "num_speculative_tokens": 3},
                      **tiny_engine_options(strict=True, max_num_batched_tokens=96))
    try:
        assert_same_outputs_over_random_requests(llm, speculative)
        stats = speculative.stats()
        assert stats.graphs_compiled_after_warmup == 0
        counts = stats.spec_decode
        assert counts.num_drafts > 0
        if method == "draft_model":
            assert counts.num_draft_tokens > counts.num_accepted_tokens > 0
    finally:
        speculative.shutdown()


COUNT_GRAPHS = textwrap.dedent("""
    import json, sys
    from tpu_executor import LLM
    from tpu_executor.core.buckets import BucketPlan
    llm = LLM(sys.argv[1], device=sys.argv[2], max_model_len=64, max_num_seqs=4, prefill_buckets=(32, 64),
              decode_buckets=(2, 4), decode_context_buckets=(64,), max_prefill_seqs=4, cache_dir=None,
              num_blocks=32, show_progress=False)
    print(json.dumps([llm.stats().graphs_compiled_at_warmup, len(BucketPlan.from_config(llm.engine.config).graphs())]))
""")


@pytest.mark.parametrize("device", ["xla", "jax"])
def test_warmup_compiles_exactly_the_graphs_of_the_bucket_plan(checkpoints, tmp_path, device):
    """In a fresh process (XLA's in-memory cache would serve graphs an earlier engine compiled):
    prefill 32, 64; decode rows 2, 4 x one context width; sampler rows 2, 4 x logprobs or not
    x greedy or not x logits processing or not; one processing-state graph; prompt log-probs
    per prefill bucket = 2 + 2 + 16 + 1 + 2 graphs, each compiled once."""
    result = subprocess.run([sys.executable, "-c", COUNT_GRAPHS, checkpoints["llama"], device], cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled, planned = json.loads(result.stdout.strip().splitlines()[-1])
    assert compiled == planned == 23


def test_preemption_gives_the_same_tokens(checkpoints, llm):
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (40, 90, 130, 60, 100)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(48), use_tqdm=False)]
    # 30 usable blocks of 16 tokens cannot hold five sequences of up to 178 tokens at once.
    small = LLM(model=checkpoints["llama"], device=device_of(llm),
                **tiny_engine_options(num_blocks=31, max_num_batched_tokens=96))
    outs = small.generate(prompts, greedy(48), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert small.stats().num_preemptions > 0, "the test must exercise preemption"
    assert small.stats().graphs_compiled_after_warmup == 0


def test_tokens_read_back_a_step_late_change_nothing(checkpoints, llm):
    """On a compiled path the worker queues step N+1 before it reads step N's tokens back (its pending
    inputs come from the device's token feed); outputs equal the synchronous engine's, with
    preemption, chunks, stops, n = 2, seeds and log-probs."""
    worker = llm.engine.core.executor.workers[0]
    queued_at_collect = []
    collect = worker.collect_step
    worker.collect_step = lambda: queued_at_collect.append(len(worker._launched)) or collect()
    prompts, params = random_requests(60, seed=3)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del worker.collect_step
    # 30 usable blocks: the synchronous engine preempts, the asynchronous one does not.
    sync = LLM(model=checkpoints["llama"], device=device_of(llm), async_scheduling=False,
               **tiny_engine_options(num_blocks=31, max_num_batched_tokens=96))
    expected = sync.generate(prompts, params, use_tqdm=False)
    assert output_summary(got) == output_summary(expected)
    torch.testing.assert_close(logprob_values(got), logprob_values(expected), rtol=1e-4, atol=1e-4)
    assert sync.stats().num_preemptions > 0
    assert max(queued_at_collect) == 2, "step N+1 must be on the device before step N is read"
    assert llm.stats().graphs_compiled_after_warmup == sync.stats().graphs_compiled_after_warmup == 0


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    prompt = {"prompt_token_ids": list(range(10, 60))}
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234, n=3, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    # The same seed alone in the batch or beside other requests draws the same tokens.
    mixed = llm.generate([prompt, {"prompt_token_ids": [7] * 30}], [params, params], use_tqdm=False)
    assert [c.token_ids for c in mixed[0].outputs] == [c.token_ids for c in first.outputs]


def test_n_samples_share_the_prompt_blocks(llm):
    prompt = {"prompt_token_ids": list(range(200, 250))}  # 3 full blocks + 2 tokens
    before = llm.stats().prefix_cache_hits
    out = llm.generate(prompt, SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [6] * 4
    assert llm.stats().prefix_cache_hits - before == 3 * 48  # samples 2-4 reuse the first one's blocks
    assert llm.stats().kv_blocks_used == 0


def test_stop_string_and_text(llm):
    prompt = {"prompt_token_ids": list(range(20, 50))}
    full = llm.generate(prompt, greedy(30), use_tqdm=False)[0].outputs[0]
    stop = full.text[len(full.text) // 2:][:3]
    assert stop.strip(), "the test needs visible text to stop on"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[:full.text.index(stop)]


def test_abort_mid_generation_returns_blocks(llm):
    engine = llm.engine
    keep = engine.add_request({"prompt_token_ids": list(range(3, 40))}, greedy(10))
    gone = engine.add_request({"prompt_token_ids": list(range(3, 80))}, greedy(50))
    first, second = engine.step(), engine.step()
    engine.abort_request(gone)
    finished = accumulate_deltas(first + second + run_to_end(engine) + engine.step())
    assert finished[gone].outputs[0].finish_reason == "abort"
    assert len(finished[keep].outputs[0].token_ids) == 10
    assert engine.stats().kv_blocks_used == 0


def test_prefix_cache_hit_gives_the_same_tokens(llm):
    prefix = list(range(100, 164))  # four full blocks
    first = llm.generate({"prompt_token_ids": prefix + [5, 6, 7]}, greedy(16), use_tqdm=False)
    hits_before = llm.engine.core.kv_cache.find_cached_prefix(prefix + [9])[1]
    assert hits_before == 64
    second = llm.generate({"prompt_token_ids": prefix + [5, 6, 7]}, greedy(16), use_tqdm=False)
    assert second[0].outputs[0].token_ids == first[0].outputs[0].token_ids
