"""Rotary position embedding (Neox/Hugging Face "rotate half" layout)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions (a device tensor, never a constant)."""

    def __init__(self, head_dim: int, theta: float, rope_type: str = "default",
                 scaling_factor: Optional[float] = None):
        super().__init__()
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / float(scaling_factor)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, heads, d], k [T, kv_heads, d] -> rotated (same shapes and dtype)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def rope_from_config(hf_config, head_dim: int) -> RotaryEmbedding:
    """Build RoPE from a transformers config (``rope_parameters`` or legacy ``rope_theta``)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return RotaryEmbedding(head_dim, float(theta), rope_type, params.get("factor"))
