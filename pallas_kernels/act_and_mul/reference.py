"""THE reference for ``act_and_mul``: a gated MLP's activation, ``act(gate) * up``.

  x    [..., 2 * width]: each row's gate features, then its up features (the merged
       gate/up projection's output)
Returns [..., width] in x's dtype. ``activation``: ``silu``, ``gelu_pytorch_tanh`` (GELU's
tanh approximation) or ``gelu`` (exact), transformers' names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def act_and_mul(x: torch.Tensor, *, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of the two halves of x's last dimension."""
    gate, up = x.chunk(2, dim=-1)
    return ACTIVATIONS[activation](gate) * up
