"""THE reference for the weight-only INT8 matmul (W8A16): the executable spec and the CPU path.

Shapes:
  x       [t, k]      activations (fp32 or bf16)
  weight  [k, n]      int8, symmetric: the real weight is ``weight * scale``
  scale   [n]         one scale per output channel (fp32), or
          [k // group, n]  one per ``group`` input features and output channel (group-wise,
                      as llm-compressor's W8A16 preset writes them)
Returns [t, n] in x's dtype: dequantize the weight to x's dtype, then matmul.
"""
from __future__ import annotations

from typing import Optional

import torch


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` (per output channel, or group-wise when ``scale`` has the weight's
    rank), in ``dtype``."""
    if scale.dim() == weight.dim():
        return (weight.float() * scale.float().repeat_interleave(weight.shape[-2] // scale.shape[-2], dim=-2)).to(dtype)
    return weight.to(dtype) * scale.to(dtype).unsqueeze(-2)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                 tp_split: Optional[str] = None) -> torch.Tensor:
    """``tp_split`` (how a mesh splits the weight: ``"columns"``, ``"rows"``) changes nothing
    here: XLA partitions this."""
    return x @ dequantize(weight, scale, x.dtype)


def quantize_per_channel(weight: torch.Tensor):
    """Symmetric INT8 per output channel of a ``[..., k, n]`` weight: (int8 weight, fp32 scale
    ``[..., n]``) with ``scale = max|w| / 127`` over the input dimension."""
    w = weight.float()
    scale = w.abs().amax(dim=-2).clamp(min=1e-12) / 127.0
    quantized = torch.round(w / scale.unsqueeze(-2)).clamp(-127, 127).to(torch.int8)
    return quantized, scale


def quantize_groups(weight: torch.Tensor, group: int):
    """Symmetric INT8 in groups of ``group`` input features of a ``[k, n]`` weight: (int8
    weight, fp32 scale ``[k // group, n]``)."""
    k, n = weight.shape[-2:]
    if k % group:
        raise ValueError(f"INT8 groups of {group} must divide the {k} input features")
    grouped = weight.float().reshape(k // group, group, n)
    scale = grouped.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    quantized = torch.round(grouped / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.reshape(k, n), scale
