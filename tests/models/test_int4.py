"""INT4 weight-only quantization (W4A16): packing and group-wise scales, the op against its
reference, and an INT4 engine equal to transformers on the dequantized checkpoint."""
from __future__ import annotations

import glob
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.common import greedy_tokens, hf_greedy, mixed_prompts, tiny_engine_options
from tpu_executor import LLM
from tpu_executor.kernels.w4a16_matmul.reference import dequantize, pack, quantize_int4, unpack
from tpu_executor.models.layers.linear import int4_group
from tpu_executor.worker.model_loader import load_model, quantizable_bytes

# The checkpoint tensors our engines quantize: the attention and MLP projections and the
# experts' (not the router, the embeddings or the LM head).
QUANTIZED = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(w[123]|gate_proj|up_proj|"
                       r"down_proj))\.weight$")


def test_packing_round_trips_and_sign_extends_both_nibbles():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(4).reshape(8, 8)  # every value in both halves
    packed = pack(q)
    assert packed.shape == (4, 8) and packed.dtype == torch.int8
    assert torch.equal(unpack(packed), q)


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_quantization_round_trips_within_half_a_step(symmetric):
    weight = torch.randn(3, 256, 48, generator=torch.Generator().manual_seed(0))  # leading dims: experts
    packed, scale, zero = quantize_int4(weight, 64, symmetric)
    assert packed.shape == (3, 128, 48) and scale.shape == (3, 4, 48) and (zero is None) == symmetric
    error = (dequantize(packed, scale, zero, torch.float32) - weight).abs()
    assert bool((error <= scale.repeat_interleave(64, dim=-2) / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="must divide half"):
        quantize_int4(weight[:, :96], 64)


def dequantized_checkpoint(src: str, dst: str) -> str:
    """A copy of checkpoint ``src`` whose quantized projections hold their INT4 values (the
    engine's groups, dequantized to fp32): what an INT4 engine computes with."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(path)
        for name, weight in tensors.items():
            if QUANTIZED.match(name):  # Hugging Face's [out, in]; ours [in, out], grouped along in
                packed, scale, _ = quantize_int4(weight.float().t(), int4_group(weight.shape[1]))
                tensors[name] = dequantize(packed, scale, None, torch.float32).t().contiguous().to(weight.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "mixtral"])
def test_an_int4_engine_equals_transformers_on_the_dequantized_checkpoint(checkpoints, arch, tmp_path):
    """Native path, fp32 activations: greedy tokens equal transformers' on a checkpoint whose
    projections hold the INT4 values; the quantized layers take at most 20% of their fp32 bytes."""
    path = dequantized_checkpoint(checkpoints[arch], str(tmp_path / arch))
    prompts = mixed_prompts(4, 5, 40, vocab=500, seed=5)
    expected, _ = hf_greedy(path, prompts, 12)
    llm = LLM(path, device="cpu", quantization="int4", **tiny_engine_options())
    assert greedy_tokens(llm, prompts, 12) == expected
    llm.shutdown()
    assert len({t for tokens in expected for t in tokens}) > 4  # context-dependent outputs
    model = load_model(path, torch.float32, quantization="int4")
    ratio = quantizable_bytes(model) / quantizable_bytes(load_model(path, torch.float32))
    assert ratio <= 0.20, ratio
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("_q4")} == {torch.int8}
