"""Which rows of the hidden-state tap buffers hold which tokens over one step (EAGLE-3).

An EAGLE-3 head reads three of the target's hidden states per position. Every model call of
the target copies them into device buffers (``HiddenTaps``): the runner gives each call's real
tokens the next free rows and notes their KV slots; padding tokens (whose K/V goes to the null
block) share a discard row. A (request, position) has one KV slot in a step, so after the step
a slot finds its position's row whatever calls the step made (prefill packs, decode rows,
verifies, a mixed call), and the head's catch-up gathers its inputs on the device. The buffers
keep their shape, so the compiled graphs that write and read them never change.
"""
from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch


class HiddenTapRows:
    """The tap buffers of one target (``buffers[j]``: layer ``layer_ids[j]``'s inputs, one row
    per token of a step, then the discard row) and the rows the current step has used."""

    def __init__(self, layer_ids: Tuple[int, ...], buffers: List[torch.Tensor], block_size: int):
        self.layer_ids = layer_ids
        self.buffers = buffers
        self.block_size = block_size
        self.discard = buffers[0].shape[0] - 1
        self.capturing = False
        self._slots: List[np.ndarray] = []
        self._used = 0

    def begin_step(self) -> None:
        """Start a step's rows from the first (the previous step's are read already)."""
        self._slots, self._used, self.capturing = [], 0, True

    def end_step(self) -> None:
        self.capturing = False

    def rows_for(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The buffer row each token of a target call writes, by its KV slot (host tensor): the
        next free rows for its real tokens while a step is captured, the discard row otherwise."""
        slots, rows, real = self._split(slot_mapping)
        if self.capturing:
            if self._used + len(real) > self.discard:
                raise RuntimeError(f"a step computed more than the {self.discard} tokens its hidden-state "
                                   "taps hold")
            rows[real] = np.arange(self._used, self._used + len(real))
            self._slots.append(slots[real])
            self._used += len(real)
        return torch.from_numpy(rows)

    def rows_at(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """The buffer row holding each token's hidden states, by its KV slot (host tensor; the
        step computed every real one), the discard row for padding."""
        slots, rows, real = self._split(slot_mapping)
        if len(real):
            written = np.concatenate(self._slots) if self._slots else np.zeros(0, dtype=np.int64)
            order = np.argsort(written, kind="stable")
            found = order[np.minimum(np.searchsorted(written[order], slots[real]), max(len(written) - 1, 0))]
            if not len(written) or not np.array_equal(written[found], slots[real]):
                raise RuntimeError("EAGLE-3: the target's step did not compute every position the head catches up on")
            rows[real] = found  # rows were handed out in the order the slots were written
        return torch.from_numpy(rows)

    def _split(self, slot_mapping: torch.Tensor) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the slots, a discard row for each, the indices of the real tokens: padding writes the
        null block, block 0)."""
        slots = slot_mapping.numpy()
        return slots, np.full(len(slots), self.discard, dtype=np.int64), np.flatnonzero(slots >= self.block_size)
