"""The EAGLE-3 head of speculative decoding (``eagle3``), run beside the target as a
``PagedDrafter`` (``worker/paged_drafter.py``).

The head reads three of the target's hidden states per position (``models/eagle3.py``). They
are taken from the target's own step, without a second pass: each of the target's calls copies
the inputs of the three layers into tap buffers on the device, and a KV slot finds each
position's row (``worker/hidden_taps.py``).

After the step's tokens are known, the head's catch-up computes, per request, the positions the
target computed that stay in its text, each with the token after it (the next prompt token
after a chunk that does not end its prompt), into the head's one-layer KV cache. Its last
position gives the first draft and leaves the head's pre-norm output in a buffer row of the
request's drafting row; ``k - 1`` greedy decode steps, each on the head's own pre-norm output
before it, give the others.
"""
from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.step import PrefillWork
from tpu_executor.models.layers.attention import write_rows
from tpu_executor.worker.hidden_taps import HiddenTapRows
from tpu_executor.worker.model_runner import ModelRunner
from tpu_executor.worker.paged_drafter import KVCaches, PagedDrafter, StepText, attention_metadata, step_slots


class Eagle3Runner(PagedDrafter):
    """Runs an EAGLE-3 head (``models.eagle3.Eagle3Head``) beside the target's runner."""

    kind = "EAGLE-3 head"

    def __init__(self, config: EngineConfig, head: torch.nn.Module, target: torch.nn.Module, device: torch.device,
                 runtime=None):
        # The compiled functions read the target's embedding too, when the head borrows it.
        weights = nn.ModuleDict({"head": head, "target_embedding": target.model.embed_tokens})
        super().__init__(config, head, device, runtime, weights=weights)
        self.hidden_size = head.config.hidden_size
        self.target_hidden_size = target.config.hidden_size
        self.max_step_tokens = config.scheduler.max_num_batched_tokens + self.max_rows * (self.num_drafts + 1)
        self.dtype = head.norm.weight.dtype  # the activations' (d2t, the first parameter, holds ids)
        self.taps: Optional[HiddenTapRows] = None
        self.draft_hidden = torch.empty(0)  # per drafting row, the head's latest pre-norm output
        self._catch_up_fn = self.compiled(partial(eagle_catch_up, head))
        self._steps_fn = self.compiled(partial(eagle_draft_steps, head, num_steps=self.num_drafts - 1,
                                               block_size=self.block_size))

    def _buffer_shapes(self) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """(each tap buffer's: a row per token a step computes, then a discard row; the drafting
        rows' pre-norm outputs': a row per sequence, then a discard row)."""
        return (self.max_step_tokens + 1, self.target_hidden_size), (self.max_rows + 1, self.hidden_size)

    def reserved_bytes(self, block_bytes: int) -> int:
        """The scratch blocks, the tap buffers and the drafting rows' pre-norm outputs."""
        (tap_rows, tap_width), (rows, width) = self._buffer_shapes()
        elements = tap_rows * tap_width * len(self.model.aux_layer_ids) + rows * width
        return super().reserved_bytes(block_bytes) + elements * self.dtype.itemsize

    def device_state(self) -> List[torch.Tensor]:
        """The KV cache's pages, the tap buffers and the drafting rows' pre-norm outputs."""
        return super().device_state() + list(self.taps.buffers) + [self.draft_hidden]

    def bind(self, runner: ModelRunner, kv_caches: KVCaches, num_shared_blocks: int, zeros: Callable) -> None:
        """As ``PagedDrafter.bind``; the target's runner also gets the tap buffers its calls
        write the head's inputs into."""
        super().bind(runner, kv_caches, num_shared_blocks, zeros)
        tap_shape, hidden_shape = self._buffer_shapes()
        buffers = [zeros(tap_shape, self.dtype) for _ in self.model.aux_layer_ids]
        self.taps = HiddenTapRows(self.model.aux_layer_ids, buffers, self.block_size)
        runner.use_taps(self.taps)
        self.draft_hidden = zeros(hidden_shape, self.dtype)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Give the target step's tokens their tap rows (the previous step's are dropped)."""
        self.taps.begin_step()
        try:
            yield
        finally:
            self.taps.end_step()

    def _catch_up_pack(self, texts: Sequence[StepText], max_model_len: int) -> List[PrefillWork]:
        """Per request, its positions the target computed that stay, each with the token after
        it (the head's input there); a chunk that does not end its prompt takes the next prompt
        token. Rows whose next token is not known yet (none) are left out."""
        pack = []
        for text in texts:
            tokens = text.computed + text.new
            next_token_id = getattr(text.work, "next_token_id", None)  # set on a chunk that does not end its prompt
            if not text.new and next_token_id is not None:
                tokens += (next_token_id,)
            inputs = tokens[1:max_model_len - text.start + 1]
            drafts = bool(text.new) and len(inputs) == len(tokens) - 1
            if inputs:
                pack.append(self._row_work(len(pack), text.work, inputs, text.start, drafts))
        return pack

    def _run_catch_up(self, inputs: Dict[str, torch.Tensor], logit_rows: Sequence[Optional[int]]) -> torch.Tensor:
        """The head over a catch-up pack: its inputs gathered from the tap rows of the positions'
        slots (padding: the discard row); each drafting row's pre-norm output kept."""
        hidden_rows = np.full(len(inputs["logits_indices"]), self.max_rows, dtype=np.int64)  # padding: discard
        hidden_rows[:len(logit_rows)] = [self.max_rows if row is None else row for row in logit_rows]
        host = {**inputs, "tap_index": self.taps.rows_at(inputs["slot_mapping"]),
                "hidden_rows": torch.from_numpy(hidden_rows)}
        return self._catch_up_fn(**self.runner.put(host), tap_buffers=self.taps.buffers,
                                 draft_hidden=self.draft_hidden, kv_caches=self.kv_caches)

    def _run_steps(self, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self._steps_fn(**self.runner.put(inputs), draft_hidden=self.draft_hidden, kv_caches=self.kv_caches)


def eagle_catch_up(head, input_ids, positions, slot_mapping, logits_indices, tap_index, hidden_rows, tap_buffers,
                   draft_hidden, kv_caches, **attention) -> torch.Tensor:
    """The head over a catch-up call (``attention``: a prefill pack's keys or decode rows'
    block tables; the target's hidden states at ``tap_index`` of the tap buffers): the greedy
    token after each of ``logits_indices``, whose pre-norm outputs go to ``hidden_rows`` of
    ``draft_hidden``."""
    aux = torch.cat([buffer[tap_index] for buffer in tap_buffers], dim=-1)
    normed, prenorm = head(input_ids, head.combine(aux), kv_caches,
                           attention_metadata(positions, slot_mapping, **attention))
    write_rows(draft_hidden, hidden_rows, prenorm[logits_indices])
    return head.draft_tokens(normed[logits_indices])


def eagle_draft_steps(head, first_drafts: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                      draft_hidden: torch.Tensor, kv_caches, num_steps: int, block_size: int) -> torch.Tensor:
    """``num_steps`` greedy decode steps of the head, unrolled in one call, after each row's
    first draft at ``positions``, each on the head's pre-norm output before it (row ``i`` of
    ``draft_hidden`` first): the rows' next drafts."""
    hidden = draft_hidden[:first_drafts.shape[0]]
    tokens, drafts = first_drafts, []
    for step in range(num_steps):
        slots, context_lens = step_slots(positions + step, block_tables, block_size)
        meta = attention_metadata(positions + step, slots, block_tables=block_tables, context_lens=context_lens)
        normed, hidden = head(tokens, hidden, kv_caches, meta)
        tokens = head.draft_tokens(normed)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)
