"""The batched LoRA matmul in the forms that serve it (``reference.py`` is the contract).

``one_hot``: for traced graphs (torch_xla, JAX: XLA on a TPU or a CPU). Every adapter slot's A
side by side is one ``[in, adapter slots x rank]`` matmul; a one-hot selection of each token's
slot keeps its own columns; one ``[adapter slots x rank, out]`` matmul expands them. Two dense
matmuls of a few dozen columns, static shapes, no per-token copy of a weight (the reference's
gather copies ``in x rank`` values per token: 512 MiB for a 2,048-token prefill at 4,096 x 16 in
fp32). Slots stay apart even when one holds an inf or a NaN (the engine refuses such adapters;
this is the second line): the columns are selected with ``torch.where``, never multiplied by a
mask (``0 * inf`` is NaN), and B's non-finite values enter the expansion as zeros, so they reach
no other slot's tokens and no base token (that slot's own rows then differ from the reference's).
Selecting each slot's rows after an expansion of its own would keep the reference's values there
too, at the cost of a ``[tokens, out]`` output per slot (a prefill's largest buffers, times the
slots).

``grouped``: for eager calls where the C kernel (``cpu_native.py``) does not serve (bf16, a
GPU): the slots a call uses are read on the host, and each one's tokens take ``(x @ A) @ B``
once; slot 0's (no adapter) stay zero.

Both expand a packed layer's projections each through its own block of B (``out_slices``):
the zeros between them are never multiplied.
"""
from __future__ import annotations

import torch

from tpu_executor.kernels.lora_matmul.reference import Slices, blocks


def one_hot(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
            out_slices: Slices = None) -> torch.Tensor:
    """Same contract as ``reference.lora_matmul``; dense matmuls over every adapter slot at
    once (slot 0, the base model, holds no adapter and takes no columns)."""
    num_slots, in_features, rank = lora_a.shape
    adapters = num_slots - 1
    every_a = lora_a[1:].permute(1, 0, 2).reshape(in_features, adapters * rank).float()
    shrunk = x.float() @ every_a  # [tokens, adapter slots x rank]
    slot_ids = torch.arange(1, num_slots, device=slots.device)[None, :]
    mine = (slot_ids == slots[:, None]).repeat_interleave(rank, dim=1)  # [tokens, adapter slots x rank]
    # Selected, not multiplied by the mask: another slot's inf or NaN in A never survives here.
    shrunk = torch.where(mine, shrunk, 0.0).reshape(x.shape[0], adapters, rank)
    parts = []
    for columns, features in blocks(rank, lora_b.shape[2], out_slices):
        width = columns.stop - columns.start
        every_b = lora_b[1:, columns, features].reshape(adapters * width, -1).float()
        # A token meets every slot's B with zeros outside its own slot's columns: 0 * inf would be
        # NaN in its row, so B's non-finite values count as zero (only that slot's rows differ).
        every_b = torch.where(torch.isfinite(every_b), every_b, 0.0)
        parts.append((features, shrunk[:, :, columns].reshape(x.shape[0], adapters * width) @ every_b))
    return _joined(x, lora_b.shape[2], parts).to(x.dtype)


def grouped(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
            out_slices: Slices = None) -> torch.Tensor:
    """Same contract as ``reference.lora_matmul``; the tokens of each slot in use together
    (untraced: reads ``slots`` on the host)."""
    out = x.new_zeros(x.shape[0], lora_b.shape[2])
    for slot in torch.unique(slots).tolist():
        if slot == 0:  # no adapter
            continue
        rows = (slots == slot).nonzero()[:, 0]
        shrunk = x.index_select(0, rows).float() @ lora_a[slot].float()
        parts = [(features, shrunk[:, columns] @ lora_b[slot, columns, features].float())
                 for columns, features in blocks(lora_a.shape[2], lora_b.shape[2], out_slices)]
        out.index_copy_(0, rows, _joined(x, lora_b.shape[2], parts, rows=len(rows)).to(x.dtype))
    return out


def _joined(x: torch.Tensor, out_features: int, parts, rows: int = None) -> torch.Tensor:
    """The projections' (fp32) updates side by side (features no slice covers: zero)."""
    if covers(out_features, [features for features, _ in parts]):
        return torch.cat([update for _, update in parts], dim=1)
    out = x.new_zeros(x.shape[0] if rows is None else rows, out_features, dtype=torch.float32)
    for features, update in parts:
        out[:, features] = update
    return out


def covers(out_features: int, features) -> bool:
    """Whether the slices run over every output feature, in order, without a gap."""
    ends = [0] + [f.stop for f in features]
    return all(f.start == end for f, end in zip(features, ends)) and ends[-1] == out_features
