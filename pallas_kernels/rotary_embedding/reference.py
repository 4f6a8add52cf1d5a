"""THE reference for ``rotary_embedding``: RoPE in the Neox / Hugging Face "rotate half" layout.

  x         [T, heads, d]: any heads (q's and k's side by side are fine)
  cos, sin  [T, 1, d]: each token's angles' cosines and sines, both halves (the second half
            repeats the first), already multiplied by any attention scaling
Returns x rotated, ``x * cos + rotate_half(x) * sin`` computed in fp32, in x's dtype.
"""
from __future__ import annotations

import torch


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x turned by each token's angles."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
