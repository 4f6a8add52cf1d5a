"""THE reference for the weight-only INT4 matmul (W4A16): the executable spec.

Shapes:
  x       [t, k]        activations (fp32 or bf16)
  packed  [k // 2, n]   int8, two 4-bit weights a byte: byte ``[i, j]`` holds weight
                        ``[i, j]`` in its low nibble and ``[i + k // 2, j]`` in its high one,
                        each a signed value in [-8, 7] (so a kernel reads one byte for two
                        rows, each half of the input features from its own half of x)
  scale   [k // group, n]  fp32: one scale per ``group`` input features and output feature
  zero    [k // group, n]  fp32 or None: the real weight is ``(q - zero) * scale`` (None: 0,
                        symmetric); asymmetric formats (GPTQ, AWQ: unsigned q and zero) are
                        turned into this one when loaded
``group`` is ``k // scale.shape[0]``; it divides ``k // 2`` (a byte's two weights never share
a group). Returns [t, n] in x's dtype: dequantize the weight to x's dtype, then matmul.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The int8 weights ``[k, n]`` (each in [-8, 7]) held in ``packed [k // 2, n]``."""
    # The low nibble sign-extended without a left shift: torch_xla's int8 shift left does not
    # wrap at 8 bits (measured: (x << 4) >> 4 gave x back).
    low = torch.bitwise_xor(torch.bitwise_and(packed, 0x0F), 0x08) - 0x08
    return torch.cat([low, torch.bitwise_right_shift(packed, 4)], dim=-2)


def pack(weight_q: torch.Tensor) -> torch.Tensor:
    """``[k, n]`` int8 weights in [-8, 7] (k even) as ``[k // 2, n]`` bytes (see the module doc)."""
    half = weight_q.shape[-2] // 2
    low, high = weight_q[..., :half, :], weight_q[..., half:, :]
    return torch.bitwise_or(torch.bitwise_and(low, 0x0F), torch.bitwise_left_shift(high, 4)).to(torch.int8)


def group_size(packed: torch.Tensor, scale: torch.Tensor) -> int:
    """Input features per scale: ``k // scale.shape[-2]``."""
    return 2 * packed.shape[-2] // scale.shape[-2]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
               dtype: torch.dtype) -> torch.Tensor:
    """The real weight ``[k, n]`` in ``dtype``."""
    group = group_size(packed, scale)
    weight = unpack(packed).float()
    if zero is not None:
        weight = weight - zero.float().repeat_interleave(group, dim=-2)
    return (weight * scale.float().repeat_interleave(group, dim=-2)).to(dtype)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 zero: Optional[torch.Tensor] = None, *, tp_split: Optional[str] = None) -> torch.Tensor:
    """``tp_split``: as ``w8a16_matmul``'s, nothing here."""
    return x @ dequantize(packed, scale, zero, x.dtype)


def quantize_int4(weight: torch.Tensor, group: int,
                  symmetric: bool = True) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A ``[..., k, n]`` weight as (packed, scale, zero) in groups of ``group`` input features.
    Symmetric: ``scale = max|w| / 7`` a group, q = round(w / scale) in [-7, 7], no zero.
    Asymmetric: the group's [min, max] over 16 levels, q in [-8, 7] and ``zero`` the level of 0."""
    *lead, k, n = weight.shape
    if k % 2 or (k // 2) % group:
        raise ValueError(f"INT4 groups of {group} must divide half the {k} input features")
    grouped = weight.float().reshape(*lead, k // group, group, n)
    if symmetric:
        scale = grouped.abs().amax(dim=-2).clamp(min=1e-12) / 7.0
        q = torch.round(grouped / scale.unsqueeze(-2)).clamp(-7, 7)
        zero = None
    else:
        low, high = grouped.amin(dim=-2).clamp(max=0), grouped.amax(dim=-2).clamp(min=0)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        zero = torch.round(-low / scale) - 8  # the level that holds 0, shifted to signed
        q = (torch.round(grouped / scale.unsqueeze(-2)) + zero.unsqueeze(-2)).clamp(-8, 7)
    return pack(q.reshape(*lead, k, n).to(torch.int8)), scale, zero
