"""LoRA adapter slots of a parallel linear layer (multi-LoRA serving).

A layer that serves adapters keeps, for each of ``num_slots`` slots, its A and B padded to the
slot rank: ``lora_a [slots, in, shards x rank]`` and ``lora_b [slots, shards x rank, out]``,
this rank's part of each. Slot 0 stays zero (the base model). A packed layer (QKV, gate/up)
holds each packed projection's adapter in its own ``rank`` columns of A and, block-diagonally,
in the rows of B over that projection's output features (``lora_out_slices``: no product runs
over the zeros between), so one ``lora_matmul`` gives every projection's update. PEFT's scale
goes into B when the slot is written.

Tensor parallelism splits the adapters as the layer's weight: a column-parallel layer keeps
its output features' columns of B (A whole); a row-parallel layer its input features' rows of
A (B whole), and its partial products join the base layer's before the all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpu_executor.kernels.lora_matmul.ops import lora_matmul


class LoRASlots:
    """The adapter slots of a linear layer; mixed into the parallel linears, which say how
    their adapters split (``_lora_shapes``, ``_lora_out``, ``_lora_parts``, ``_lora_slices``).

    The slots are written on the host, into ``lora_a_host`` and ``lora_b_host``; the buffers
    ``lora_a`` and ``lora_b`` that the model calls read are those tensors until the model moves
    to a device, then device copies, replaced by a whole transfer after each write
    (``lora_buffers_on_device``): an update on the device would be a program of its own to
    compile."""

    def enable_lora(self, num_slots: int, max_rank: int, dtype: torch.dtype) -> None:
        """Zeroed adapter slots (slot 0 stays zero: the base model)."""
        if "weight_q" in self._parameters or "weight_q4" in self._parameters:
            raise ValueError("LoRA adapters over a quantized model are not served: load the base model "
                             "unquantized to serve adapters")
        (in_rows, columns), out = self._lora_shapes(max_rank), self._lora_out()
        self.lora_a_host = torch.zeros(num_slots, in_rows, columns, dtype=dtype)
        self.lora_b_host = torch.zeros(num_slots, columns, out, dtype=dtype)
        self.register_buffer("lora_a", self.lora_a_host, persistent=False)
        self.register_buffer("lora_b", self.lora_b_host, persistent=False)
        self.lora_rank = max_rank
        self.lora_out_slices = self._lora_slices()

    def set_lora(self, slot: int, shard_id, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        """Write one projection's adapter into ``slot`` (on the host): ``lora_a [r, in]`` and
        ``lora_b [out, r]`` as PEFT stores them (whole, every rank's part), ``scale`` PEFT's.
        ValueError, writing nothing, when a value is not finite in the slots' dtype."""
        if slot < 1:
            raise ValueError("slot 0 is the base model's: adapters go in slots 1 and up")
        rank = lora_a.shape[0]
        if rank > self.lora_rank or lora_b.shape[-1] != rank:
            raise ValueError(f"an adapter of rank {rank} (B's rank {lora_b.shape[-1]}) does not fit slots of rank "
                             f"{self.lora_rank} (max_lora_rank)")
        a_part, b_part, column, (out_start, out_len) = self._lora_parts(shard_id, lora_a, lora_b)
        with torch.no_grad():
            a_part = a_part.t().to(self.lora_a_host.dtype)
            scaled = (b_part.float() * scale).t().to(self.lora_b_host.dtype)
            # A value too large for the slots' dtype (or for B times its scale) becomes infinite.
            if not (bool(torch.isfinite(a_part).all()) and bool(torch.isfinite(scaled).all())):
                raise ValueError(f"its A, or its B scaled by {scale:g}, is not finite in {self.lora_a_host.dtype}")
            self.lora_a_host[slot, :, column:column + rank] = a_part
            self.lora_b_host[slot, column:column + rank, out_start:out_start + out_len] = scaled

    def clear_lora(self, slot: int) -> None:
        """Zero ``slot`` (on the host: its adapter unloaded or about to be replaced)."""
        with torch.no_grad():
            self.lora_a_host[slot].zero_()
            self.lora_b_host[slot].zero_()

    @property
    def lora_buffers_on_device(self) -> bool:
        """Whether the model calls read device copies of the host slots (replaced after writes)."""
        return self.lora_a is not self.lora_a_host

    def lora_delta(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Each token's update through its slot's adapter; None when the layer or the call
        has no adapters."""
        if lora_slots is None or "lora_a" not in self._buffers:
            return None
        return lora_matmul(x, self.lora_a, self.lora_b, lora_slots, self.lora_out_slices)


def check_shape(what: str, tensor: torch.Tensor, expected) -> None:
    """Raise naming the adapter tensor whose shape does not match its base layer."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(tensor.shape)}, the base layer needs {tuple(expected)}: "
                         "the adapter was trained for another model")
