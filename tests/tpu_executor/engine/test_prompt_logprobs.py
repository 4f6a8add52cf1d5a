"""Prompt log-probs (``SamplingParams.prompt_logprobs``): every prompt token's log-prob given the
tokens before it, its rank and the top alternatives, equal to transformers' log-softmax over the
prompt (fp32, within 1e-4), for prompts cut into chunks, on the native path and on XLA, with
nothing compiled after warm-up; a prompt owed them is never served from the prefix cache."""
from __future__ import annotations

import pytest
import torch

from tests.common import assert_nothing_compiled_after_warmup, mixed_prompts, tiny_engine_options
from tpu_executor import LLM, SamplingParams

DEVICES = [pytest.param("xla", marks=pytest.mark.slow), "cpu"]


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, checkpoints):
    # A 64-token budget: the longer prompts run as several chunks.
    engine = LLM(checkpoints["llama"], device=request.param,
                 **tiny_engine_options(strict=True, max_num_batched_tokens=64, prefill_buckets=(32, 64)))
    yield engine
    engine.shutdown()


def transformers_logprobs(path, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_prompt_logprobs_equal_transformers(llm, checkpoints):
    prompts = mixed_prompts(4, 2, 200, vocab=500, seed=8)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = transformers_logprobs(checkpoints["llama"], prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entries, row = out.prompt_logprobs[position], expected[position - 1]
            top = torch.topk(row, 3).indices.tolist()
            assert set(entries) == {prompt[position], *top}
            torch.testing.assert_close(torch.tensor(list(entries.values())), row[list(entries)], atol=1e-4, rtol=0)
            assert out.prompt_logprob_ranks[position] == int((row > row[prompt[position]]).sum()) + 1
    assert_nothing_compiled_after_warmup(llm)


def test_a_prompt_owed_logprobs_is_computed_whole(llm):
    prompt = {"prompt_token_ids": list(range(10, 150))}
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # now cached
    hits = llm.stats().prefix_cache_hits
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    assert llm.stats().prefix_cache_hits == hits
    assert all(entries is not None and len(entries) == 1 for entries in out.prompt_logprobs[1:])


def test_prompt_logprobs_above_the_engine_max_are_refused(llm):
    with pytest.raises(ValueError, match="prompt_logprobs 30 exceeds max_logprobs 20"):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(prompt_logprobs=30), use_tqdm=False)
