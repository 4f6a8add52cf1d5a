"""THE reference for the batched LoRA matmul: each token's adapter delta, by its slot.

Shapes:
  x       [num_tokens, in_features]
  lora_a  [num_slots, in_features, rank]    each slot's A, scaled and zero-padded to ``rank``
  lora_b  [num_slots, rank, out_features]   each slot's B
  slots   [num_tokens] int                  the slot of each token's adapter
Returns [num_tokens, out_features] in x's dtype: row ``t`` is
``(x[t] @ lora_a[slots[t]]) @ lora_b[slots[t]]``, computed in fp32, and zero for a token of
slot 0 (the base model: no adapter; slot 0's A and B are never read).

The engine keeps a packed layer's adapters side by side in
``rank`` (each packed projection's A in its own columns, its B block-diagonal over them), so
one call gives every projection's delta.
"""
from __future__ import annotations

import torch


def lora_matmul(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each token's ``x @ A @ B`` through the A and B of its slot (gathered per token)."""
    a = lora_a.index_select(0, slots).float()  # [tokens, in, rank]
    b = lora_b.index_select(0, slots).float()  # [tokens, rank, out]
    shrunk = torch.bmm(x.float()[:, None, :], a)  # [tokens, 1, rank]
    delta = torch.bmm(shrunk, b)[:, 0]
    return (delta * (slots != 0)[:, None]).to(x.dtype)
