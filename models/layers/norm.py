"""RMSNorm in both flavours: Llama's ``w * x`` and Gemma's ``(1 + w) * x``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpu_executor.kernels.binding import eager_only


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and eager_only(x):
            # The same steps as below in one call: torch's rms_norm upcasts, scales by the
            # reciprocal root of the mean square plus eps, then multiplies by the weight.
            weight = 1.0 + self.weight if self.unit_offset else self.weight
            return F.rms_norm(x, (x.shape[-1],), weight.float(), self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)
