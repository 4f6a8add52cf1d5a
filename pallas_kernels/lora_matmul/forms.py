"""The batched LoRA matmul in the forms that serve it (``reference.py`` is the contract).

``one_hot``: for traced graphs (torch_xla, JAX: XLA on a TPU or a CPU). Every slot's A side by
side is one ``[in, slots x rank]`` matmul; a one-hot mask of each token's slot keeps its own
columns; one ``[slots x rank, out]`` matmul expands them. Two dense matmuls of a few dozen
columns, static shapes, no per-token copy of a weight (the reference's gather copies
``in x rank`` values per token: 512 MiB for a 2,048-token prefill at 4,096 x 16 in fp32).

``grouped``: for eager calls (the native path): the slots a call uses are read on the host,
and each one's tokens take ``(x @ A) @ B`` once; slot 0's (no adapter) stay zero.
"""
from __future__ import annotations

import torch


def one_hot(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.lora_matmul``; dense matmuls over every slot at once."""
    num_slots, in_features, rank = lora_a.shape
    every_a = lora_a.permute(1, 0, 2).reshape(in_features, num_slots * rank).float()
    shrunk = x.float() @ every_a  # [tokens, slots x rank]
    slot_ids = torch.arange(num_slots, device=slots.device)[None, :]
    mine = (slot_ids == slots[:, None]) & (slot_ids != 0)  # [tokens, slots]: slot 0 takes no adapter
    shrunk = shrunk * mine.repeat_interleave(rank, dim=1).to(shrunk.dtype)
    return (shrunk @ lora_b.reshape(num_slots * rank, -1).float()).to(x.dtype)


def grouped(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.lora_matmul``; the tokens of each slot in use together
    (untraced: reads ``slots`` on the host)."""
    out = x.new_zeros(x.shape[0], lora_b.shape[2])
    for slot in torch.unique(slots).tolist():
        if slot == 0:  # no adapter
            continue
        rows = (slots == slot).nonzero()[:, 0]
        delta = (x.index_select(0, rows).float() @ lora_a[slot].float()) @ lora_b[slot].float()
        out.index_copy_(0, rows, delta.to(x.dtype))
    return out
