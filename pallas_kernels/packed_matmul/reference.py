"""THE reference for ``packed_matmul``: ``x @ W`` with the weight packed into panels once.

  x       [T, K]
  panels  [ceil(N / 16), K, 16]: ``pack(W)`` of a weight W [K, N]; panel p holds output
          features 16p .. 16p + 15 (zeros past N), so a panel's sixteen features at one input
          feature are contiguous
Returns [T, out_features] (= N) in x's dtype. The layout is what the CPU kernel
(``cpu_gemm.c``) streams; the native CPU path packs its fp32 linear layers this way after
loading, and no traced graph sees it.
"""
from __future__ import annotations

import torch

PANEL = 16  # output features per panel: one vector of sixteen fp32 lanes


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [K, N] -> its panels [ceil(N / 16), K, 16], zero-padded past N."""
    in_features, out_features = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, -out_features % PANEL))
    return padded.reshape(in_features, padded.shape[1] // PANEL, PANEL).transpose(0, 1).contiguous()


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [K, out_features] that ``pack`` stored in ``panels``."""
    return panels.transpose(0, 1).reshape(panels.shape[1], panels.shape[0] * PANEL)[:, :out_features]


def packed_matmul(x: torch.Tensor, panels: torch.Tensor, *, out_features: int) -> torch.Tensor:
    """``x @ W`` for the weight W packed in ``panels``."""
    return x @ unpack(panels, out_features)
