"""Tensor parallelism over Ray actors on CPU: one local node advertising 4 "TPU" chips.

Each rank is an actor wrapping a Worker; collectives go through gloo on host copies, so the
compiled step splits at every collective. Greedy tokens at tp=2 and tp=4 must equal
transformers' (fp32); the tiny models have 4 query heads and 2 KV heads, so tp=4 replicates
each KV head on two ranks (Gemma-3's one KV head is replicated at tp=2).
"""
from __future__ import annotations

import time

import pytest
import ray

from tests.common import (
    POISON_ALL_RANKS,
    POISON_RANK_1,
    engine_with_worker,
    faulty_worker_class,
    greedy_tokens,
    hf_greedy,
    mixed_prompts,
    ray_session,
    run_to_end,
    tensor_parallel_options,
)
from tpu_executor import LLM, EngineDeadError, SamplingParams

pytestmark = pytest.mark.slow  # Ray actors, one per simulated chip

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_session(str(tmp_path_factory.mktemp("ray")), num_cpus=2, resources={"TPU": 4}):
        yield


@pytest.fixture(scope="module")
def prompts():
    return mixed_prompts(4, 5, 40, vocab=512, seed=7)


@pytest.fixture(scope="module")
def references(checkpoints, prompts):
    """Transformers' fp32 greedy tokens per architecture, computed on first use."""
    return LazyReferences(lambda arch: hf_greedy(checkpoints[arch], prompts, NEW_TOKENS)[0])


class LazyReferences(dict):
    """A dict of reference tokens that computes each architecture's on its first look-up."""

    def __init__(self, compute):
        super().__init__()
        self._compute = compute

    def __missing__(self, arch):
        self[arch] = self._compute(arch)
        return self[arch]


def assert_all_chips_come_back(timeout_s: float = 20.0) -> None:
    """The cluster's 4 chips are free again within ``timeout_s`` (a placement group is
    released asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("TPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("TPU") == 4


# On XLA (the heavy tier), tp=2 replicates Gemma-3's single KV head and splits Qwen3-MoE's experts; tp=4 (each
# of two KV heads on two ranks, experts in quarters) runs on the native path below, whose ranks
# compile nothing. (Every architecture runs at tp=1 in the parity tests.)
@pytest.mark.parametrize("arch,tp", [("gemma3", 2), ("qwen3_moe", 2)])
def test_greedy_tokens_match_transformers(cluster, checkpoints, references, prompts, arch, tp):
    hf_tokens = references[arch]
    llm = LLM(checkpoints[arch], tensor_parallel_size=tp, **tensor_parallel_options())
    try:
        assert len(llm.engine.core.executor.actors) == tp
        assert greedy_tokens(llm, prompts, NEW_TOKENS) == hf_tokens
        if tp == 2:
            # Fresh random lengths after warm-up: strict mode would raise on a compilation.
            greedy_tokens(llm, mixed_prompts(6, 2, 60, vocab=512, seed=11), 8)
            assert llm.engine.stats().graphs_compiled_after_warmup == 0
    finally:
        llm.shutdown()


def test_core_process_drives_the_ray_workers(cluster, checkpoints, references, prompts):
    """The core in a process of its own joins the front-end's Ray cluster (no address given)
    and drives tp=2 actors there: the same tokens, and no compilation after warm-up."""
    llm = LLM(checkpoints["llama"], tensor_parallel_size=2, core_process=True, **tensor_parallel_options())
    try:
        assert greedy_tokens(llm, prompts, NEW_TOKENS) == references["llama"]
        greedy_tokens(llm, mixed_prompts(6, 2, 60, vocab=512, seed=11), 8)
        assert llm.engine.stats().graphs_compiled_after_warmup == 0
        assert ray.available_resources().get("TPU", 0) == 2  # the core's actors hold two chips
    finally:
        llm.shutdown()
    assert_all_chips_come_back()  # the core gave its chips back


def test_native_path_at_tp4_matches_transformers(cluster, checkpoints, references, prompts):
    """Gemma's two KV heads each replicated on two of the four ranks; with speculative decoding
    by a draft model (the target itself), which splits over the ranks as the target does:
    every rank runs the draft's steps and the verifies (the LM head's logits all-gathered),
    and every draft holds."""
    target = checkpoints["gemma"]
    speculative = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = LLM(target, device="cpu", tensor_parallel_size=4, speculative_config=speculative,
              **tensor_parallel_options())
    try:
        assert greedy_tokens(llm, prompts, NEW_TOKENS) == references["gemma"]
        counts = llm.engine.stats().spec_decode
        assert counts.num_drafts > 0 and counts.num_accepted_tokens == counts.num_draft_tokens
    finally:
        llm.shutdown()


def test_native_path_eagle3_head_at_tp2_matches_transformers(cluster, checkpoints, references, prompts, tmp_path):
    """An EAGLE-3 head split over two ranks as the target (its attention's heads, its LM head's
    vocabulary): every rank drafts from its own capture of the target's hidden states."""
    from tpu_executor.tools.eagle3_head import write_random_eagle3_head

    target = checkpoints["llama"]
    head = write_random_eagle3_head(target, str(tmp_path / "head"), draft_vocab_size=300)
    speculative = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    llm = LLM(target, device="cpu", tensor_parallel_size=2, speculative_config=speculative,
              **tensor_parallel_options())
    try:
        assert greedy_tokens(llm, prompts, NEW_TOKENS) == references["llama"]
        assert llm.engine.stats().spec_decode.num_drafts > 0
    finally:
        llm.shutdown()


def test_lora_adapters_split_over_two_ranks_equal_one_rank(cluster, checkpoints, prompts, tmp_path):
    """Three LoRA adapters and the base in one batch over two slots at tp = 2 (column-parallel
    B and row-parallel A split with their layers, the partial products summed with the base's):
    the tokens of tp = 1."""
    from tpu_executor import LoRARequest
    from tpu_executor.tools.lora_adapter import write_random_lora_adapter

    base = checkpoints["llama"]
    adapters = [None] + [LoRARequest(f"a{i}", i + 1, write_random_lora_adapter(base, str(tmp_path / f"a{i}"), seed=i))
                         for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts for _ in adapters]
    per_prompt = [a for _ in prompts for a in adapters]
    tokens = {}
    for tp in (1, 2):
        llm = LLM(base, device="cpu", tensor_parallel_size=tp, enable_lora=True, max_loras=2,
                  **tensor_parallel_options())
        try:
            outputs = llm.generate(requests, params, use_tqdm=False, lora_request=per_prompt)
            assert all(o.error is None for o in outputs)
            tokens[tp] = [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.shutdown()
    assert tokens[2] == tokens[1]
    assert tokens[1][1::len(adapters)] != tokens[1][0::len(adapters)]  # an adapter changes the tokens


def test_launch_script_checks_the_cluster_then_generates(cluster, checkpoints, capsys):
    from scripts import launch

    address = ray.get_runtime_context().gcs_address
    with pytest.raises(ValueError, match="needs 8 TPU chips but the Ray cluster has 4"):
        launch.main(["--ray-address", address, "--tensor-parallel-size", "8", "--check-only"])
    launch.main(["--ray-address", address, "--tensor-parallel-size", "2", checkpoints["llama"],
                 "--device", "cpu", "--prompt", "ka lo mi", "--no-chat-template", "--max-tokens", "8",
                 "--max-model-len", "96", "--prefill-buckets", "96", "--decode-buckets", "4",
                 "--decode-context-buckets", "96"])
    out = capsys.readouterr().out
    assert "4 TPU chips" in out and "tensor_parallel_size 2: the cluster has the chips" in out
    assert "8 tokens in" in out and "recompilations after warm-up: 0" in out


def test_impossible_split_fails_before_any_worker_starts(cluster, checkpoints):
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by tensor_parallel_size 3"):
        LLM(checkpoints["llama"], tensor_parallel_size=3, **tensor_parallel_options())


@pytest.mark.parametrize("async_scheduling, call", [(True, "launch_step"), (False, "execute_model")])
def test_a_lost_worker_fails_in_flight_requests_and_shuts_down(cluster, checkpoints, prompts, async_scheduling, call):
    llm = LLM(checkpoints["llama"], device="cpu", tensor_parallel_size=2, async_scheduling=async_scheduling,
              **tensor_parallel_options())
    engine = llm.engine
    actors = list(engine.core.executor.actors)
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=64)) for p in prompts]
    engine.step()
    engine.step()
    ray.kill(actors[1])
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=f"worker rank 1 failed in {call}") as failure:
        while True:
            engine.step()
    assert time.monotonic() - start < 60
    assert sorted(o.request_id for o in failure.value.outputs) == sorted(ids)
    assert all(o.error and "worker rank 1" in o.error for o in failure.value.outputs)
    assert engine.core.executor.actors == [] and not engine.has_unfinished_requests()
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request({"prompt_token_ids": prompts[0]}, SamplingParams())
    assert_all_chips_come_back()


def test_a_worker_exception_fails_only_its_step(cluster, checkpoints, references, prompts):
    """Under Ray as in-process: an exception inside every rank's step fails that step's
    requests and the engine serves on; one rank failing a step the others ran is fatal."""
    # A short collective timeout: rank 0 waits in vain for rank 1 in the fatal case.
    engine = engine_with_worker(checkpoints["llama"], faulty_worker_class(), device="cpu", tensor_parallel_size=2,
                                **tensor_parallel_options(collective_timeout_s=5))
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    healthy = engine.add_request({"prompt_token_ids": prompts[1]}, greedy)
    engine.step()
    doomed = engine.add_request({"prompt_token_ids": [5, POISON_ALL_RANKS, 7]}, greedy)
    failed = {}  # read back a call later with asynchronous scheduling
    while doomed not in failed:
        failed.update({o.request_id: o for o in engine.step()})
    assert failed[doomed].error == failed[healthy].error == "RuntimeError: device fell over"
    assert failed[doomed].finished and failed[healthy].outputs[0].finish_reason == "error"
    again = engine.add_request({"prompt_token_ids": prompts[0]}, greedy)
    tokens = [t for d in run_to_end(engine) if d.request_id == again for t in d.outputs[0].token_ids]
    assert tokens == references["llama"][0]
    assert engine.stats().kv_blocks_used == 0
    engine.add_request({"prompt_token_ids": [5, POISON_RANK_1, 7]}, greedy)
    with pytest.raises(EngineDeadError, match="fell out of step .*rank 1: RuntimeError: device fell over"):
        run_to_end(engine)
    assert engine.core.executor.actors == []


def test_mixtral_experts_split_over_four_ranks(cluster, checkpoints, references, prompts):
    """Each rank holds a quarter of every expert's intermediate dimension (8 experts, top-2)."""
    expected = references["mixtral"]
    llm = LLM(checkpoints["mixtral"], device="cpu", tensor_parallel_size=4, **tensor_parallel_options())
    try:
        assert greedy_tokens(llm, prompts, NEW_TOKENS) == expected
    finally:
        llm.shutdown()
