"""Write published-format quantized copies of a checkpoint (test checkpoints for the loaders).

- compressed-tensors, with the format's own library (``compressed-tensors``, a test
  dependency): its quantization config applied to the transformers model, round-to-nearest
  scales from each group's range (``calculate_qparams``), compressed and saved by
  ``ModelCompressor`` as llm-compressor saves them.
- GPTQ (v1 ``gptq`` format) and AWQ (GEMM), written here from their documented tensor
  layouts (see ``worker/checkpoint_formats.py``): round-to-nearest, asymmetric, unsigned
  levels; GPTQ optionally in act order (a random permutation of the input features fills the
  groups, as ``desc_act`` orders them by the Hessian).

Round-to-nearest is not GPTQ's or AWQ's calibration, but the tensors are laid out exactly as
theirs: what a loader reads is the same.

    python -m tpu_executor.tools.quantized_checkpoint SRC DST --format gptq --bits 4 --group 32
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import zlib
from typing import Dict, Optional, Tuple

import torch

from tpu_executor.worker.checkpoint_formats import AWQ_ORDER

# Checkpoint tensors a published checkpoint quantizes: attention and MLP projections, and
# experts (not the router, the embeddings or the LM head).
QUANTIZED = re.compile(r".*\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|experts\.\d+\.(w[123]|gate_proj|up_proj|"
                       r"down_proj))\.weight$")


def round_to_nearest(weight: torch.Tensor, bits: int, group: int,
                     groups: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric unsigned levels of ``weight [out, in]`` in groups of ``group`` input features
    (``groups``: each feature's group, act order): (q int32 [out, in] in [0, 2^bits), scale
    [out, in / group], zero int32 [out, in / group] in [1, 2^bits - 1] (GPTQ's v1 format
    cannot store a zero of 0)."""
    out, k = weight.shape
    groups = torch.arange(k) // group if groups is None else groups
    top = (1 << bits) - 1
    low = torch.zeros(out, k // group).scatter_reduce(1, groups.expand(out, k), weight.float(), "amin")
    high = torch.zeros(out, k // group).scatter_reduce(1, groups.expand(out, k), weight.float(), "amax")
    scale = ((high - low) / top).clamp(min=1e-6)
    zero = torch.round(-low / scale).clamp(1, top).to(torch.int32)
    q = (torch.round(weight.float() / scale[:, groups]) + zero[:, groups]).clamp(0, top).to(torch.int32)
    return q, scale, zero


def pack_int32(levels: torch.Tensor, bits: int, dim: int, order: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """Unsigned ``levels`` packed ``32 / bits`` to an int32 along ``dim``, low bits first
    (slot ``i`` of a word holding entry ``order[i]`` of its run when ``order`` is given)."""
    per_word = 32 // bits
    moved = levels.movedim(dim, -1)
    runs = moved.reshape(*moved.shape[:-1], -1, per_word).to(torch.int64)
    if order is not None:
        runs = runs[..., list(order)]
    words = (runs << (torch.arange(per_word) * bits)).sum(-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim).contiguous()


def gptq_tensors(weight: torch.Tensor, bits: int, group: int, act_order: bool, seed: int) -> Dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales``, ``g_idx`` of one ``[out, in]`` weight."""
    k = weight.shape[1]
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order else torch.arange(k)
    groups = torch.empty(k, dtype=torch.int64)
    groups[order] = torch.arange(k) // group
    q, scale, zero = round_to_nearest(weight, bits, group, groups)
    return {"qweight": pack_int32(q.t(), bits, 0), "qzeros": pack_int32(zero.t() - 1, bits, 1),
            "scales": scale.t().to(torch.float16).contiguous(), "g_idx": groups.to(torch.int32)}


def awq_tensors(weight: torch.Tensor, group: int) -> Dict[str, torch.Tensor]:
    """``qweight``, ``qzeros``, ``scales`` of one ``[out, in]`` weight (AWQ's GEMM layout)."""
    q, scale, zero = round_to_nearest(weight, 4, group)
    return {"qweight": pack_int32(q.t(), 4, 1, AWQ_ORDER), "qzeros": pack_int32(zero.t(), 4, 1, AWQ_ORDER),
            "scales": scale.t().to(torch.float16).contiguous()}


def write_gptq_or_awq(src: str, dst: str, method: str, bits: int = 4, group: int = 32,
                      act_order: bool = False, seed: int = 0) -> str:
    """A copy of ``src`` with its projections in ``method``'s (``gptq`` or ``awq``) tensors."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        tensors, written = load_file(path), {}
        for name, tensor in sorted(tensors.items()):
            if not QUANTIZED.match(name):
                written[name] = tensor
                continue
            prefix = name[:-len(".weight")]
            parts = gptq_tensors(tensor, bits, group, act_order, seed + _input_key(prefix)) if method == "gptq" else \
                awq_tensors(tensor, group)
            written.update({f"{prefix}.{part}": value for part, value in parts.items()})
        save_file(written, path, metadata={"format": "pt"})
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
              "checkpoint_format": "gptq"} if method == "gptq" else \
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    _set_quantization_config(dst, config)
    return dst


def _input_key(prefix: str) -> int:
    """A number per layer input: projections that read the same input (q, k and v; gate and
    up) share it, so their act orders agree (GPTQ orders by statistics of the input)."""
    shared = re.sub(r"\.([qkv]_proj|w[13]|gate_proj|up_proj)$", ".input", prefix)
    return zlib.crc32(shared.encode())


def _set_quantization_config(path: str, config: dict) -> None:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        data = json.load(f)
    data["quantization_config"] = config
    with open(config_file, "w") as f:
        json.dump(data, f, indent=2)


def write_compressed_tensors(src: str, dst: str, bits: int = 4, group: Optional[int] = 32,
                             symmetric: bool = True, fmt: str = "pack-quantized", activations: bool = False) -> str:
    """A copy of ``src`` quantized and saved by the compressed-tensors library: ``bits``-bit
    weights of every decoder Linear, by ``group`` (None: by output channel); integers, or FP8
    (E4M3) for ``fmt`` ``float-quantized``; ``activations``: with INT8 activations quantized
    per token at run time (W8A8, as llm-compressor's preset)."""
    from compressed_tensors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    args = QuantizationArgs(num_bits=bits, type="float" if fmt == "float-quantized" else "int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group)
    dynamic = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=dynamic if activations else None)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head", "re:.*mlp.gate$"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            _set_round_to_nearest_qparams(module, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    return dst


def _set_round_to_nearest_qparams(module: torch.nn.Module, args) -> None:
    """The module's scale (and zero point) from each group's [min, max], as a min-max
    observer gives them."""
    from compressed_tensors.quantization.utils import calculate_qparams

    weight = module.weight.detach().float()
    grouped = weight.reshape(weight.shape[0], -1, args.group_size or weight.shape[1])
    scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
    if hasattr(module, "weight_zero_point"):
        module.weight_zero_point.data.copy_(zero.reshape(module.weight_zero_point.shape))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    parser.add_argument("--format", choices=["gptq", "awq", "compressed-tensors", "fp8"], required=True)
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group", type=int, default=32)
    parser.add_argument("--act-order", action="store_true", help="GPTQ: desc_act")
    args = parser.parse_args(argv)
    if args.format in ("compressed-tensors", "fp8"):
        float_weights = args.format == "fp8"
        write_compressed_tensors(args.src, args.dst, 8 if float_weights else args.bits,
                                 None if float_weights else args.group,
                                 fmt="float-quantized" if float_weights else "pack-quantized")
    else:
        write_gptq_or_awq(args.src, args.dst, args.format, args.bits, args.group, args.act_order)
    print(args.dst)


if __name__ == "__main__":
    main()
