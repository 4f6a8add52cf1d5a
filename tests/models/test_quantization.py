"""INT8 weight-only quantization (W8A16): size of the quantized layers, the op against its
reference, and how often greedy tokens agree with the unquantized model."""
from __future__ import annotations

from typing import List

import pytest
import torch

from tests.common import greedy_tokens, mixed_prompts, tiny_engine_options
from tpu_executor import LLM
from tpu_executor.kernels.w8a16_matmul import ops as w8a16_ops
from tpu_executor.kernels.w8a16_matmul.reference import dequantize, quantize_per_channel
from tpu_executor.tools.random_checkpoint import ARCHITECTURES
from tpu_executor.worker.model_loader import load_model, quantizable_bytes

SMOLLM2_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain in one sentence what a compiler does.", "List three primary colors.",
    "Give me a synonym for happy.", "What is 12 times 7?",
    "Name a planet in our solar system.", "Translate 'good morning' into Spanish.",
]
SMOLLM2_NEW_TOKENS = 32
MIN_AGREEMENT = 0.90


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_quantized_layers_take_at_most_30_percent_of_fp32(checkpoints, arch):
    full = quantizable_bytes(load_model(checkpoints[arch], torch.float32))
    quantized_model = load_model(checkpoints[arch], torch.float32, quantization="int8")
    ratio = quantizable_bytes(quantized_model) / full
    print(f"{arch}: quantized layers {ratio:.1%} of their fp32 bytes")
    assert ratio <= 0.30
    kinds = {p.dtype for n, p in quantized_model.named_parameters() if n.endswith(("weight_q", "w13_q", "w2_q"))}
    assert kinds == {torch.int8}


def test_per_channel_quantization_round_trips_within_half_a_step():
    weight = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    quantized, scale = quantize_per_channel(weight)
    assert quantized.dtype == torch.int8 and scale.shape == (48,)
    error = (dequantize(quantized, scale, torch.float32) - weight).abs()
    assert bool((error <= scale / 2 + 1e-7).all())


@pytest.mark.parametrize("dtype, rounding", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_w8a16_matmul_is_within_quantization_error_of_the_fp32_matmul(dtype, rounding):
    """The op (whichever provider the registry picks) on a quantized weight, against the fp32
    matmul of the original weight: output j may differ by at most sum_i |x_i| * scale_j / 2
    (each weight is off by at most half a step), plus the activation dtype's rounding. A scale
    on the wrong axis, a wrong sign or a missing scale breaks the bound."""
    from tpu_executor.kernels import register_all

    register_all()
    gen = torch.Generator().manual_seed(0)
    for t, k, n in [(1, 64, 32), (8, 128, 256), (37, 128, 32)]:
        weight = torch.randn(k, n, generator=gen) / k ** 0.5 * torch.rand(n, generator=gen) * 4  # scales differ
        x = torch.randn(t, k, generator=gen).to(dtype)
        quantized, scale = quantize_per_channel(weight)
        out = w8a16_ops.w8a16_matmul(x, quantized, scale).float()
        exact = x.float() @ weight
        bound = x.float().abs().sum(-1, keepdim=True) * scale / 2 + rounding * (x.float().abs() @ weight.abs())
        error = (out - exact).abs()
        assert bool((error <= bound).all()), f"t={t} k={k} n={n}: worst excess {(error - bound).max():.3g}"
        assert error.max() > 0  # the quantization error is real, so the bound is what holds it


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma3_mm"])
def test_int8_engines_of_every_family_follow_fp32(checkpoints, arch):
    """An INT8 engine of each family serves (native path), and its first greedy token equals
    the fp32 engine's for at least 3 prompts in 4."""
    prompts = mixed_prompts(16, 16, 96, vocab=500, seed=9)
    firsts = {}
    for quantization in (None, "int8"):
        llm = LLM(checkpoints[arch], device="cpu", quantization=quantization, **tiny_engine_options())
        firsts[quantization] = [t[0] for t in greedy_tokens(llm, prompts, 1)]
        llm.shutdown()
    same = sum(a == b for a, b in zip(firsts[None], firsts["int8"]))
    print(f"{arch}: int8 first token equal to fp32's for {same} of {len(prompts)} prompts")
    assert same >= 12


def _smollm2_prompts(tokenizer) -> List[List[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in SMOLLM2_PROMPTS]
    return [tokenizer(text)["input_ids"] for text in texts]


@pytest.mark.slow
def test_smollm2_int8_greedy_agrees_with_fp32(smollm2_path):
    """At every output position of the fp32 model's greedy completions, the INT8 model,
    given the same prefix, picks the same greedy token at least 90% of the time.

    Also printed: free-running agreement (each model continues its own text), where one early
    flip changes every later position, so it measures divergence more than quantization error.
    """
    options = dict(device="cpu", max_model_len=256, max_num_seqs=8, prefill_buckets=(128, 256),
                   decode_buckets=(8,), decode_context_buckets=(256,), cache_dir=None, show_progress=False,
                   num_blocks=256)
    fp32 = LLM(smollm2_path, **options)
    prompts = _smollm2_prompts(fp32.get_tokenizer())
    reference = greedy_tokens(fp32, prompts, SMOLLM2_NEW_TOKENS, ignore_eos=False)
    fp32.shutdown()
    int8 = LLM(smollm2_path, quantization="int8", **options)
    prefixes = [p + r[:i] for p, r in zip(prompts, reference) for i in range(len(r))]
    next_tokens = [t[0] for t in greedy_tokens(int8, prefixes, 1, ignore_eos=False)]
    expected = [t for r in reference for t in r]
    agreement = sum(a == b for a, b in zip(next_tokens, expected)) / len(expected)
    free = greedy_tokens(int8, prompts, SMOLLM2_NEW_TOKENS, ignore_eos=False)
    free_same = sum(a == b for r, o in zip(reference, free) for a, b in zip(r, o))
    print(f"SmolLM2 int8 vs fp32 over {len(expected)} positions: same greedy token given the same prefix "
          f"{agreement:.1%}; free-running {free_same / len(expected):.1%}")
    assert agreement >= MIN_AGREEMENT
