"""THE reference for the batched LoRA matmul: each token's adapter delta, by its slot.

Shapes:
  x       [num_tokens, in_features]
  lora_a  [num_slots, in_features, rank]    each slot's A, scaled and zero-padded to ``rank``
  lora_b  [num_slots, rank, out_features]   each slot's B
  slots   [num_tokens] int                  the slot of each token's adapter
  out_slices  ((start, length), ...) or None: a packed layer's projections. The rank columns
              split evenly among them in order, and slice i's columns feed only its output
              features ``start .. start + length`` (B is block-diagonal; what lies outside the
              blocks is never read). None: one projection, every column to every feature.
Returns [num_tokens, out_features] in x's dtype: row ``t`` is
``(x[t] @ lora_a[slots[t]]) @ lora_b[slots[t]]`` over B's blocks, computed in fp32, and zero
for a token of slot 0 (the base model: no adapter; slot 0's A and B are never read). A
non-finite value in a slot's A or B reaches no other slot's tokens and no token of slot 0, in
every form; what that slot's own rows then hold may differ between forms.

The engine keeps a packed layer's adapters side by side in ``rank`` (each packed projection's
A in its own columns, its B over that projection's features), so one call gives every
projection's delta.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

Slices = Optional[Sequence[Tuple[int, int]]]


def blocks(rank: int, out_features: int, out_slices: Slices):
    """(columns, features) of B's blocks: ``(slice(c0, c1), slice(o0, o1))`` per projection."""
    out_slices = ((0, out_features),) if out_slices is None else tuple(out_slices)
    width = rank // len(out_slices)
    return [(slice(i * width, (i + 1) * width), slice(start, start + length))
            for i, (start, length) in enumerate(out_slices)]


def lora_matmul(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                out_slices: Slices = None) -> torch.Tensor:
    """Each token's ``x @ A @ B`` through the A and B of its slot (gathered per token)."""
    a = lora_a.index_select(0, slots).float()  # [tokens, in, rank]
    b = lora_b.index_select(0, slots).float()  # [tokens, rank, out]
    shrunk = torch.bmm(x.float()[:, None, :], a)  # [tokens, 1, rank]
    delta = x.new_zeros(x.shape[0], lora_b.shape[2], dtype=torch.float32)
    for columns, features in blocks(lora_a.shape[2], lora_b.shape[2], out_slices):
        delta[:, features] = torch.bmm(shrunk[:, :, columns], b[:, columns, features])[:, 0]
    return torch.where((slots != 0)[:, None], delta, 0.0).to(x.dtype)
