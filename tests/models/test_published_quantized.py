"""Published quantized checkpoints: compressed-tensors (written by its own library, read back
by transformers as the reference), GPTQ and AWQ (written by our script from their documented
layouts, checked against a dequantizer written here from the same documentation). Our
engines hold the quantized weights and give the dequantized model's greedy tokens, log-probs
within fp32 tolerance."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.common import (
    assert_same_as_reference,
    hf_greedy,
    mixed_prompts,
    ray_session,
    tensor_parallel_options,
    tiny_engine_options,
)
from tpu_executor import LLM, SamplingParams
from tpu_executor.tools.quantized_checkpoint import write_compressed_tensors, write_gptq_or_awq
from tpu_executor.worker.model_loader import CheckpointError, load_model

PROMPTS = mixed_prompts(4, 5, 40, vocab=500, seed=5)
NEW_TOKENS = 12


def run_greedy(path: str, **options):
    llm = LLM(path, **({**tiny_engine_options(), **options}))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
                        use_tqdm=False)
    llm.shutdown()
    return outs


def assert_quantized(path: str, bits: int, dtype=torch.int8) -> None:
    """Our model holds the checkpoint's levels: INT4 packed two a byte, INT8 as int8, FP8 as FP8."""
    params = dict(load_model(path, torch.float32).named_parameters())
    levels = "qkv_proj.weight_q4" if bits == 4 else "qkv_proj.weight_q"
    held = {p.dtype for n, p in params.items() if n.endswith(levels)}
    assert held == {dtype}, held
    assert not any(n.endswith("qkv_proj.weight") for n in params)


# (arch, bits, group (None: per channel), symmetric, format)
COMPRESSED = [("llama", 4, 32, True, "pack-quantized"), ("qwen3", 4, 32, False, "pack-quantized"),
              ("gemma2", 8, None, True, "pack-quantized"), ("mistral", 8, 32, True, "int-quantized"),
              ("qwen2", 8, None, True, "float-quantized")]


@pytest.mark.parametrize("arch,bits,group,symmetric,fmt", COMPRESSED)
def test_compressed_tensors_checkpoints_equal_transformers(checkpoints, tmp_path, arch, bits, group, symmetric, fmt):
    path = write_compressed_tensors(checkpoints[arch], str(tmp_path / arch), bits, group, symmetric, fmt)
    expected_tokens, expected_logprobs = hf_greedy(path, PROMPTS, NEW_TOKENS)  # transformers decompresses
    assert len({t for tokens in expected_tokens for t in tokens}) > 4  # context-dependent outputs
    assert_same_as_reference(run_greedy(path, device="cpu"), expected_tokens, expected_logprobs)
    assert_quantized(path, bits, torch.float8_e4m3fn if fmt == "float-quantized" else torch.int8)


def unpack_fields(words: np.ndarray, bits: int) -> np.ndarray:
    """``[..., 32 / bits]``: the unsigned fields of each int32, lowest bits first (GPTQ's and
    AWQ's packing)."""
    words = words.astype(np.int32).view(np.uint32)
    return np.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)], axis=-1).astype(np.int64)


def gptq_weight(qweight, qzeros, scales, g_idx, bits):
    """AutoGPTQ's v1 format, dequantized to Hugging Face's [out, in]: ``qweight`` packs input
    features along its rows, ``qzeros`` (stored minus one) output features along its columns;
    feature ``i`` uses group ``g_idx[i]``."""
    levels = unpack_fields(qweight.numpy(), bits).transpose(0, 2, 1).reshape(-1, qweight.shape[1])
    zeros = unpack_fields(qzeros.numpy(), bits).reshape(qzeros.shape[0], -1) + 1
    g = g_idx.numpy().astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(((levels - zeros[g]) * scales.float().numpy()[g]).T, np.float32))


AWQ_PACKING = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: slot i of a word holds output feature AWQ_PACKING[i] of its 8


def awq_weight(qweight, qzeros, scales):
    """AutoAWQ's GEMM layout, dequantized to Hugging Face's [out, in]."""
    def unpack(words):
        fields = unpack_fields(words.numpy(), 4)
        ordered = np.empty_like(fields)
        ordered[..., AWQ_PACKING] = fields
        return ordered.reshape(words.shape[0], -1)

    group = qweight.shape[0] // scales.shape[0]
    levels, zeros = unpack(qweight), np.repeat(unpack(qzeros), group, axis=0)
    weight = (levels - zeros) * np.repeat(scales.float().numpy(), group, axis=0)
    return torch.from_numpy(np.ascontiguousarray(weight.T, np.float32))


def dequantized_copy(src: str, dst: str, method: str, bits: int = 4) -> str:
    """``src`` (GPTQ or AWQ) with every quantized weight dequantized by the functions above,
    its quantization config removed: the model transformers runs as the reference."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors = load_file(path)
        for prefix in [n[:-len(".qweight")] for n in tensors if n.endswith(".qweight")]:
            parts = [tensors.pop(f"{prefix}.{p}") for p in ("qweight", "qzeros", "scales")]
            if method == "gptq":
                tensors[f"{prefix}.weight"] = gptq_weight(*parts, tensors.pop(f"{prefix}.g_idx"), bits)
            else:
                tensors[f"{prefix}.weight"] = awq_weight(*parts)
        save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


# (arch, method, act order, tensor-parallel size)
GPTQ_AWQ = [("llama", "gptq", False, 1), ("qwen2", "gptq", True, 1), ("mixtral", "awq", False, 1),
            ("qwen3", "awq", False, 2)]


@pytest.mark.parametrize("arch,method,act_order,tp", GPTQ_AWQ)
def test_gptq_and_awq_checkpoints_equal_their_dequantized_models(checkpoints, tmp_path, arch, method, act_order, tp):
    """tp = 2 splits o_proj's and down_proj's groups of 32 inputs across the INT4 halves of
    each rank's slice: their scales are repeated, exactly."""
    path = write_gptq_or_awq(checkpoints[arch], str(tmp_path / arch), method, 4, 32, act_order)
    expected_tokens, expected_logprobs = hf_greedy(dequantized_copy(path, str(tmp_path / "ref"), method), PROMPTS,
                                                   NEW_TOKENS)
    assert len({t for tokens in expected_tokens for t in tokens}) > 4
    if tp == 1:
        outs = run_greedy(path, device="cpu")
    else:
        with ray_session(tempfile.mkdtemp(prefix="ray"), num_cpus=2, resources={"TPU": tp}):  # a short socket path
            outs = run_greedy(path, device="cpu", tensor_parallel_size=tp, **tensor_parallel_options())
    assert_same_as_reference(outs, expected_tokens, expected_logprobs)
    assert_quantized(path, 4)


def test_act_order_weights_whose_groups_straddle_ranks_are_refused(checkpoints, tmp_path):
    from tpu_executor.models.layers.parallel import TensorParallelGroup

    path = write_gptq_or_awq(checkpoints["llama"], str(tmp_path / "llama"), "gptq", 4, 32, act_order=True)

    class LoadingOnly(TensorParallelGroup):  # building and loading call no collective
        all_reduce = all_gather = None

    with pytest.raises(CheckpointError, match="straddle the ranks.*tensor_parallel_size 1"):
        load_model(path, torch.float32, LoadingOnly(rank=1, world_size=2))


def test_unsupported_formats_and_requantizing_are_refused(checkpoints, tmp_path):
    path = write_gptq_or_awq(checkpoints["llama"], str(tmp_path / "awq"), "awq", 4, 32)
    with pytest.raises(CheckpointError, match="already quantized .awq, 4-bit.*leave quantization unset"):
        load_model(path, torch.float32, quantization="int8")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    for quantization_config, message in [({"quant_method": "bitsandbytes"}, "quantized with 'bitsandbytes'"),
                                         ({"quant_method": "awq", "version": "gemv"}, "AWQ 'gemv'")]:
        config["quantization_config"] = quantization_config
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
        with pytest.raises(CheckpointError, match=message):
            load_model(path, torch.float32)


# The JAX engine over two virtual CPU devices (SPMD, the quantized weights split over them):
# transformers' greedy tokens on the dequantized copy, log-probs within 1e-3.
SPMD_RUN = """
import sys
from tests.common import assert_same_as_reference, hf_greedy
from tests.models.test_published_quantized import NEW_TOKENS, PROMPTS, run_greedy
path, reference = sys.argv[1:]
expected_tokens, expected_logprobs = hf_greedy(reference, PROMPTS, NEW_TOKENS)
assert_same_as_reference(run_greedy(path, device="jax", tensor_parallel_size=2), expected_tokens, expected_logprobs)
"""


@pytest.mark.slow  # XLA compilation
@pytest.mark.parametrize("device,fmt", [("xla", "fp8"), ("jax", "gptq")])
def test_compiled_engines_run_published_checkpoints(checkpoints, tmp_path, device, fmt):
    """FP8 weights (upcast in the matmul) on torch_xla; GPTQ's zero points and act-order input
    gather on the JAX path at tp = 2 (SPMD). One format a path keeps the suite short."""
    if fmt == "fp8":
        path = write_compressed_tensors(checkpoints["llama"], str(tmp_path / "llama"), 8, None, True, "float-quantized")
        expected_tokens, expected_logprobs = hf_greedy(path, PROMPTS, NEW_TOKENS)
        assert_same_as_reference(run_greedy(path, device=device), expected_tokens, expected_logprobs)
        return
    path = write_gptq_or_awq(checkpoints["llama"], str(tmp_path / "llama"), "gptq", 4, 32, act_order=True)
    reference = dequantized_copy(path, str(tmp_path / "ref"), "gptq")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", SPMD_RUN, path, reference], env=env, capture_output=True,
                            text=True, timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.returncode == 0, result.stderr[-3000:]

def test_the_jax_mesh_splits_quantized_weights_as_megatron_splits_their_layers(checkpoints, tmp_path):
    """Under SPMD every quantized layer's levels, scales and zeros are split over the chips, not
    copied to each: column-parallel ones by output features, row-parallel INT8 by input features
    (per-channel scales replicated), row-parallel packed INT4 by output features."""
    from tpu_executor.worker.jax.runtime import split_dim

    gptq = write_gptq_or_awq(checkpoints["llama"], str(tmp_path / "gptq"), "gptq", 4, 32)
    splits = {}
    for path, quantization in ((gptq, None), (checkpoints["llama"], "int8")):
        model = load_model(path, torch.float32, quantization=quantization)
        layer = model.model.layers[0]
        for module_name, module in (("qkv", layer.self_attn.qkv_proj), ("down", layer.mlp.down_proj)):
            for name, param in module.named_parameters():
                splits[(quantization or "gptq", module_name, name)] = split_dim(module, name, tuple(param.shape), 2)
    assert splits == {
        ("gptq", "qkv", "weight_q4"): 1, ("gptq", "qkv", "weight_scale"): 1, ("gptq", "qkv", "weight_zero"): 1,
        ("gptq", "down", "weight_q4"): 1, ("gptq", "down", "weight_scale"): 1, ("gptq", "down", "weight_zero"): 1,
        ("int8", "qkv", "weight_q"): 1, ("int8", "qkv", "weight_scale"): 0,
        ("int8", "down", "weight_q"): 0, ("int8", "down", "weight_scale"): None}
