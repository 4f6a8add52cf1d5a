"""RMSNorm in both flavours: Llama's ``w * x`` and Gemma's ``(1 + w) * x``, through the
``rms_norm`` op (optionally fused with the residual add before it)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tpu_executor.kernels.rms_norm.ops import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as the reference implementations do.

    ``unit_offset`` is Gemma's convention: the stored weight is a delta from 1, and the scale
    is applied before casting back (Llama casts first, then scales).
    """

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """The normed x; with ``residual``, (the normed ``x + residual``, that sum)."""
        return rms_norm(x, self.weight, eps=self.eps, unit_offset=self.unit_offset, residual=residual)
