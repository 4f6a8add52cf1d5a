"""``bench throughput --profile``: the phase table of a real engine run, parts of the model on CPU."""
from __future__ import annotations

import time

import pytest

from tpu_executor import LLM, SamplingParams
from tpu_executor.bench.profile import MODEL_PARTS, StepProfile, print_profile


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_profile_splits_prefill_and_decode_into_model_parts(checkpoints, capsys, async_scheduling):
    llm = LLM(model=checkpoints["llama"], device="cpu", max_model_len=64, async_scheduling=async_scheduling,
              show_progress=False)
    try:
        profile = StepProfile(llm.engine)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [5 + i] * (8 + i)} for i in range(3)],
                     SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - start
        profile.detach()
        model = llm.engine.core.executor.workers[0].runner.model
        assert "compute_logits" not in vars(model) and not model.model.layers[0].self_attn._forward_pre_hooks
    finally:
        llm.shutdown()
    rows = {what: (seconds, calls) for _, what, seconds, calls in profile.rows()}
    for phase in ("prefill", "decode"):
        assert rows[f"{phase}: linears"][0] > 0 and rows[f"{phase}: attention"][0] > 0
        assert f"{phase}: {MODEL_PARTS[2]}" not in rows  # no MoE layer in Llama
    assert rows["decode: linears"][1] == 3  # the first token comes from the prefill call
    assert rows["sample"][1] == rows["prefill: linears"][1] + 3
    runner = sum(seconds for part, _, seconds, _ in profile.rows() if part == "runner")
    assert runner <= wall
    print_profile("tiny llama", profile, wall)
    out = capsys.readouterr().out
    assert "| runner | decode: linears |" in out and "outside the phases" in out
