"""The EAGLE-3 head of speculative decoding (``eagle3``), in the worker, on the native path.

The head reads three of the target's hidden states per position (``models/eagle3.py``). They
are taken from the target's own step, without a second pass: forward pre-hooks on the three
target layers record the residual stream entering them, with the KV slot of each token, while
the step runs (``capture``). A (request, position) has one slot in a step, so the slots find
each position's hidden states whatever the step's calls were (prefill packs, decode rows, a
verify pack, a mixed call).

After the step's tokens are known, one packed prefill of the head computes, per request, the
positions the target computed that stay in its text, each with the token after it (the next
prompt token after a chunk that does not end its prompt), into the head's one-layer KV cache
(the target's block layout, as the draft model's). Its last position gives the first draft;
``k - 1`` greedy decode steps, each on the head's own pre-norm output, give the others.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Sequence

import numpy as np
import torch

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.step import PrefillWork, SampledTokens, SchedulerOutput
from tpu_executor.models.layers.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from tpu_executor.worker.draft_model import Drafts, PagedDrafter, StepText, padded_tables
from tpu_executor.worker.inputs import table_slots, to_device


class Eagle3Runner(PagedDrafter):
    """Runs an EAGLE-3 head (``models.eagle3.Eagle3Head``) beside the target's runner."""

    def __init__(self, config: EngineConfig, head: torch.nn.Module, target: torch.nn.Module, device: torch.device):
        super().__init__(config, head, device)
        self._capturing = False
        self._slots: List[torch.Tensor] = []  # per target call: the KV slot of each token
        self._aux: List[List[torch.Tensor]] = []  # per target call: the three layers' inputs
        self._hidden = torch.empty(0)  # the drafting rows' pre-norm output of the last draft step
        layers = target.model.layers
        for index, layer_id in enumerate(head.aux_layer_ids):
            layers[layer_id].register_forward_pre_hook(self._recorder(index))

    def _recorder(self, index: int):
        def record(_module, args):
            if not self._capturing:
                return
            hidden, _kv_cache, meta = args[:3]
            if index == 0:
                self._slots.append(meta.slot_mapping)
                self._aux.append([])
            self._aux[-1].append(hidden)
        return record

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Record the target's hidden states over one step (the previous step's are dropped)."""
        self._slots, self._aux = [], []
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    @torch.no_grad()
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The drafts that follow the tokens of each request of ``step.drafting`` once
        ``sampled`` (the step's tokens) are recorded; every request's positions enter the
        head's cache."""
        pack = self._catch_up_pack(self._step_texts(step, sampled))
        if not pack:
            return {}
        host_inputs = self._pack_inputs(pack)
        hidden = self.model.combine(self._target_hidden(host_inputs["slot_mapping"].numpy()))
        inputs = to_device(host_inputs, self.device)
        self._slots, self._aux = [], []
        prefill = PrefillMetadata(inputs["context_slots"], inputs["key_positions"], inputs["key_segments"],
                                  inputs["query_segments"])
        meta = AttentionMetadata(inputs["positions"], inputs["slot_mapping"], prefill=prefill)
        normed, prenorm = self.model(inputs["input_ids"], hidden, self.kv_caches, meta)
        rows = self._drafting_rows(step, pack)
        if not rows:
            return {}
        last = inputs["logits_indices"][rows]
        self._hidden = prenorm[last]
        return self._draft_steps(self.model.draft_tokens(normed[last]), pack, rows, self._decode)

    def _catch_up_pack(self, texts: Sequence[StepText]) -> List[PrefillWork]:
        """Per request, its positions the target computed that stay, each with the token after
        it (the head's input there); a chunk that does not end its prompt takes the next prompt
        token. Rows whose next token is not known yet (none) are left out."""
        pack = []
        for text in texts:
            tokens = text.computed + text.new
            next_token_id = getattr(text.work, "next_token_id", None)  # set on a chunk that does not end its prompt
            if not text.new and next_token_id is not None:
                tokens += (next_token_id,)
            if len(tokens) > 1:
                pack.append(self._row_work(len(pack), text.work, tokens[1:], text.start, bool(text.new)))
        return pack

    def _target_hidden(self, wanted: np.ndarray) -> torch.Tensor:
        """The target's three hidden states at the KV slots ``wanted`` (the catch-up pack's
        positions), side by side, found among those the step computed."""
        slots = torch.cat(self._slots).cpu().numpy()
        aux = torch.cat([torch.cat(layers, dim=-1) for layers in self._aux])
        order = np.argsort(slots, kind="stable")
        found = order[np.minimum(np.searchsorted(slots[order], wanted), len(slots) - 1)]
        if not np.array_equal(slots[found], wanted):
            raise RuntimeError("EAGLE-3: the target's step did not compute every position the head catches up on")
        return aux[torch.from_numpy(found).to(aux.device)]

    def _decode_metadata(self, positions: np.ndarray, tables: np.ndarray) -> Dict[str, torch.Tensor]:
        """A decode step's attention inputs on the device: the rows' ``positions`` in ``tables``."""
        slots = table_slots(tables, positions, self.block_size)
        host = {"positions": positions, "slot_mapping": slots, "block_tables": tables, "context_lens": positions + 1}
        return to_device({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in host.items()}, self.device)

    def _draft_steps(self, first: torch.Tensor, pack: Sequence[PrefillWork], rows: List[int], step_fn) -> Drafts:
        """Drafts 2 to k after each row's ``first`` draft: ``step_fn(tokens, metadata)`` gives
        the tokens after ``tokens`` at the positions that follow the rows' pack works."""
        drafted = [first]
        positions = np.array([pack[i].num_context_tokens for i in rows], dtype=np.int64)
        tables = padded_tables([pack[i].block_ids for i in rows])
        for _ in range(self.num_drafts - 1):
            drafted.append(step_fn(drafted[-1], self._decode_metadata(positions, tables)))
            positions = positions + 1
        ids = torch.stack(drafted, dim=1).cpu().tolist()
        return {pack[i].request_id: tuple(row) for i, row in zip(rows, ids)}

    def _decode(self, tokens: torch.Tensor, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        """One greedy draft step on the head's previous pre-norm output: the tokens after ``tokens``."""
        meta = AttentionMetadata(metadata["positions"], metadata["slot_mapping"],
                                 decode=DecodeMetadata(metadata["block_tables"], metadata["context_lens"]))
        normed, self._hidden = self.model(tokens, self._hidden, self.kv_caches, meta)
        return self.model.draft_tokens(normed)

