"""THE reference for the weight-only INT8 matmul (W8A16): the executable spec and the CPU path.

Shapes:
  x       [t, k]      activations (fp32 or bf16)
  weight  [k, n]      int8, symmetric: the real weight is ``weight * scale``
  scale   [n]         one scale per output channel (fp32)
Returns [t, n] in x's dtype: dequantize the weight to x's dtype, then matmul.
"""
from __future__ import annotations

import torch


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight * scale`` along the last (output) dimension, in ``dtype``."""
    return weight.to(dtype) * scale.to(dtype).unsqueeze(-2)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x @ dequantize(weight, scale, x.dtype)


def quantize_per_channel(weight: torch.Tensor):
    """Symmetric INT8 per output channel of a ``[..., k, n]`` weight: (int8 weight, fp32 scale
    ``[..., n]``) with ``scale = max|w| / 127`` over the input dimension."""
    w = weight.float()
    scale = w.abs().amax(dim=-2).clamp(min=1e-12) / 127.0
    quantized = torch.round(w / scale.unsqueeze(-2)).clamp(-127, 127).to(torch.int8)
    return quantized, scale
