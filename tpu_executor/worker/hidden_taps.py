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

from typing import List, Sequence, Tuple

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
        """The buffer row of each token of a call with these KV slots (host tensor): the next
        free rows for its real tokens while a step is captured, the discard row otherwise."""
        slots = slot_mapping.numpy()
        rows = np.full(len(slots), self.discard, dtype=np.int64)
        if self.capturing:
            real = np.flatnonzero(slots >= self.block_size)  # padding writes the null block (block 0)
            if self._used + len(real) > self.discard:
                raise RuntimeError(f"a step computed more than the {self.discard} tokens its hidden-state "
                                   "taps hold")
            rows[real] = np.arange(self._used, self._used + len(real))
            self._slots.append(slots[real])
            self._used += len(real)
        return torch.from_numpy(rows)

    def rows_of(self, wanted: Sequence[int]) -> np.ndarray:
        """The rows that hold the positions with KV slots ``wanted`` (computed this step)."""
        wanted = np.asarray(wanted, dtype=np.int64)
        slots = np.concatenate(self._slots) if self._slots else np.zeros(0, dtype=np.int64)
        if not len(wanted):
            return wanted
        order = np.argsort(slots, kind="stable")
        found = order[np.minimum(np.searchsorted(slots[order], wanted), len(slots) - 1)] if len(slots) else wanted
        if not len(slots) or not np.array_equal(slots[found], wanted):
            raise RuntimeError("EAGLE-3: the target's step did not compute every position the head catches up on")
        return found
