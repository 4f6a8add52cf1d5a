"""Greedy tokens identical to transformers (fp32) and logits within tolerance, for a tiny random
checkpoint of every supported architecture on the native eager path (on the CPU, and on a CUDA
GPU where torch sees one) and of two architectures each on the XLA and JAX paths (prompts of
16-256 tokens, longer than the sliding windows), with nothing compiled after warm-up."""
import pytest
import torch

from tests.common import (
    assert_nothing_compiled_after_warmup,
    assert_same_as_reference,
    hf_greedy,
    mixed_prompts,
    tiny_engine_options,
)
from tpu_executor import LLM, SamplingParams
from tpu_executor.tools.random_checkpoint import ARCHITECTURES

NEW_TOKENS = 64

_references = {}


def reference(path, prompts):
    if path not in _references:
        _references[path] = hf_greedy(path, prompts, NEW_TOKENS)
    return _references[path]


NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA GPU")


# Every architecture runs on the native path (CPU, and a GPU where there is one). The compiled
# paths share the model code and differ in their kernels, so each runs the two architectures
# that reach the most kernel features: XLA Gemma-2 (sliding windows, soft-capping; in the heavy
# tier) and Mixtral (experts), JAX Gemma-3 (one KV head, sliding windows, per-layer-type RoPE)
# and Qwen3-MoE (experts, q/k norms).
COMPILED_PATHS = {"xla": ("gemma2", "mixtral"), "jax": ("gemma3", "qwen3_moe")}
CASES = [(arch, device) for arch in ARCHITECTURES for device in ("cpu", "cuda")] + [
    (arch, device) for device, archs in COMPILED_PATHS.items() for arch in archs]
MARKS = {"cuda": NO_GPU, "xla": pytest.mark.slow, "jax": pytest.mark.slow}


@pytest.mark.parametrize("arch,device", [pytest.param(*case, marks=MARKS.get(case[1], ())) for case in CASES])
def test_greedy_matches_transformers(checkpoints, arch, device):
    path = checkpoints[arch]
    prompts = mixed_prompts(6, 16, 256, vocab=500)
    ref_tokens, ref_logprobs = reference(path, prompts)
    # The random model must not degenerate into repeating one token, or parity proves nothing.
    assert all(len(set(t)) > 8 for t in ref_tokens)
    # A GPU's free memory would give a tiny model millions of KV blocks: fix the count there.
    sized = {"num_blocks": 4096} if device == "cuda" else {}
    llm = LLM(model=path, device=device, **tiny_engine_options(strict=True, **sized))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    assert_same_as_reference(outs, ref_tokens, ref_logprobs)
    assert_nothing_compiled_after_warmup(llm)
    llm.shutdown()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NO_GPU)])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompts_prefilled_beside_running_decodes_match_transformers(checkpoints, arch, device, monkeypatch):
    """On the native path (CPU or GPU) a step's last prefill pack and its decodes are one model
    call: a small token budget cuts the prompts into chunks over several steps, so chunks run
    beside the decodes of prompts already done."""
    from tpu_executor.worker.model_runner import ModelRunner

    mixed_calls = []
    launch_mixed = ModelRunner._launch_mixed
    monkeypatch.setattr(ModelRunner, "_launch_mixed",
                        lambda runner, call: mixed_calls.append(call) or launch_mixed(runner, call))
    path = checkpoints[arch]
    prompts = mixed_prompts(6, 16, 256, vocab=500)
    ref_tokens, ref_logprobs = reference(path, prompts)
    sized = {"num_blocks": 4096} if device == "cuda" else {}
    llm = LLM(model=path, device=device, **tiny_engine_options(strict=True, max_num_batched_tokens=128, **sized))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    llm.shutdown()
    assert len(mixed_calls) >= 3 and any(not call.prefill.pack[-1].is_last_chunk for call in mixed_calls)
    assert_same_as_reference(outs, ref_tokens, ref_logprobs)
