"""THE reference for the INT8 matmul with INT8 activations (W8A8): the executable spec.

Shapes:
  x       [t, k]   activations (fp32 or bf16), quantized here per token: ``x_scale [t] =
                   max|x_t| / 127``, ``x_q = round(x / x_scale)`` in [-127, 127] (dynamic, symmetric)
  weight  [k, n]   int8, symmetric
  scale   [n]      fp32, one per output channel
Returns [t, n] in x's dtype: ``(x_q @ weight)`` summed in int32 (exact), times ``x_scale[t] *
scale[n]`` in fp32.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def quantize_per_token(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 ``[t, k]``, fp32 ``[t]``): each row of ``x`` over 255 symmetric levels."""
    rows = x.float()
    x_scale = rows.abs().amax(dim=-1).clamp(min=1e-12) / 127.0
    return torch.round(rows / x_scale[:, None]).clamp(-127, 127).to(torch.int8), x_scale


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *,
                tp_split: Optional[str] = None) -> torch.Tensor:
    """``tp_split`` (how a mesh splits the weight) changes nothing here: XLA partitions this."""
    x_q, x_scale = quantize_per_token(x)
    summed = torch.matmul(x_q.to(torch.int32), weight.to(torch.int32))
    return (summed.float() * x_scale[:, None] * scale.float()[None, :]).to(x.dtype)
