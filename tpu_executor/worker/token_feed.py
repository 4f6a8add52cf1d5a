"""Sampled tokens kept on the device for the next step's inputs (asynchronous scheduling).

With asynchronous scheduling a decode's input can be the token the previous step is still
sampling (``PENDING_TOKEN``). If the worker had to read that token back to the host before
building the next step's inputs, every step would wait for the previous one to finish and
travel back, and the device would sit idle in between. Instead every sampled row of a step
writes its token into a slot of a small device buffer (inside the sampler's compiled graph);
the next step's decode graph reads its pending rows' tokens from those slots. The host only
tracks which request wrote which slot, so step N+1 can be queued on the device before step N's
tokens are read back.

Slots are handed out afresh each step: the ``k``-th sampled row of a step writes slot ``k``
(a step samples at most ``max_num_seqs`` rows). The last slot is a discard slot that padding
rows and unsampled prompt chunks write to and no one reads.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np
import torch

from tpu_executor.worker.transfer import tensor_to_device

NO_FEED = -1  # a decode row whose input token is on the host already


def fed_input_ids(input_ids: torch.Tensor, feed_slots: torch.Tensor, feed_tokens: torch.Tensor) -> torch.Tensor:
    """``input_ids`` with each row whose ``feed_slots`` entry is a slot replaced by the token
    in ``feed_tokens`` at that slot (runs inside the decode graph)."""
    fed = feed_tokens[feed_slots.clamp(min=0)]
    return torch.where(feed_slots >= 0, fed, input_ids)


def write_slots(feed_tokens: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """A copy of ``feed_tokens`` with ``token_ids`` written at ``slots`` (inside the sampler graph;
    several padding rows may write the discard slot)."""
    return feed_tokens.scatter(0, slots, token_ids)


class TokenFeed:
    """The host's side of the device token buffer: which slot holds whose token.

    ``begin_step`` starts a step; ``assign`` gives each sampled row of one sampler call its
    slot; ``pending_slots`` maps the requests sampled by the step before to their slots. The
    buffer itself is functional: the decode calls of a step read ``read_tokens`` (the buffer as
    the previous step left it) and each sampler call returns the next ``written_tokens``.
    """

    def __init__(self, max_sampled_rows: int, device: torch.device, in_use: bool = True):
        self.discard_slot = max_sampled_rows
        # Synchronous scheduling never leaves a token pending: every row writes the discard
        # slot and no request's slot is remembered (host work saved on every step).
        self.in_use = in_use
        # Made on the host, then copied: the graphs take device data, never a pending computation.
        self.written_tokens = tensor_to_device(torch.zeros(max_sampled_rows + 1, dtype=torch.int64), device)
        self.read_tokens = self.written_tokens
        self._written: Dict[str, int] = {}
        self._previous: Mapping[str, int] = {}

    @property
    def pending_slots(self) -> Mapping[str, int]:
        """Request id -> the slot its token of the previous step went to."""
        return self._previous

    def begin_step(self) -> None:
        """The step launched last becomes the previous one."""
        self._previous, self._written = self._written, {}
        self.read_tokens = self.written_tokens

    def forget(self) -> None:
        """The step being launched failed: the next one finds no tokens of it (its requests fail)."""
        self._written = {}

    def assign(self, request_ids: Sequence[Optional[str]], rows: int) -> torch.Tensor:
        """Slots for a sampler call of ``rows`` rows: a fresh slot for each request id, the
        discard slot for None (an unsampled chunk) and for the padding rows after them (for
        every row when the feed is not in use)."""
        slots = np.full(rows, self.discard_slot, dtype=np.int64)
        if not self.in_use:
            return torch.from_numpy(slots)
        sampled_ids = [request_id for request_id in request_ids if request_id is not None]
        first, count = len(self._written), len(sampled_ids)
        if first + count > self.discard_slot:
            raise ValueError(f"a step samples more than {self.discard_slot} rows (max_num_seqs)")
        if count == len(request_ids):
            slots[:count] = np.arange(first, first + count)
        else:
            slots[[row for row, request_id in enumerate(request_ids) if request_id is not None]] = \
                np.arange(first, first + count)
        self._written.update(zip(sampled_ids, range(first, first + count)))
        return torch.from_numpy(slots)
