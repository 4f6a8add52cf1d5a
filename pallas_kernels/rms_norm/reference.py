"""THE reference for ``rms_norm``: root-mean-square norm in fp32, optionally after a residual add.

  x         [..., width]
  weight    [width]
  residual  None, or x's shape and dtype: added to x first (in x's dtype, as ``x + residual``)
Returns the normed x in x's dtype, or with ``residual`` the pair (normed sum, sum): a decoder
layer's "add the block's output to the stream, then norm the stream" in one call.

``unit_offset`` is Gemma's convention: the stored weight is a delta from 1 and scales before
the cast back to x's dtype; Llama's casts first, then scales.
"""
from __future__ import annotations

from typing import Optional

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, unit_offset: bool = False,
             residual: Optional[torch.Tensor] = None):
    """The normed x (or the normed ``x + residual`` and that sum)."""
    if residual is not None:
        summed = x + residual
        return rms_norm(summed, weight, eps=eps, unit_offset=unit_offset), summed
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)
