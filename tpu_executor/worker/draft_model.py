"""The draft model of speculative decoding (``draft_model``), in the worker, on the native path.

The draft model keeps its own KV cache laid out as the target's: block ``b`` of the target's
cache and block ``b`` of the draft's hold the same positions of the same request, so the
target's block tables address both, and prefix caching and preemption carry over unchanged.

After each step's tokens are known, the draft model computes in one packed prefill, per
request, the tokens the target computed in the step that are now part of its text (a verify's
rejected drafts are left out) followed by the step's new tokens: its last position gives the
request's first draft. Then ``k - 1`` greedy decode steps give the others. Positions past a
request's blocks (its drafts' own) go to scratch blocks after the shared ones, a few per row;
the target never reads them, and the next step's prefill writes the accepted ones again into
the request's blocks. The target verifies the drafts in its next step (``worker/verify.py``):
whatever the draft model proposes, the outputs are the target's.
"""
from __future__ import annotations

import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from tpu_executor.core.buckets import context_keys
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PrefillWork, SampledTokens, SchedulerOutput
from tpu_executor.worker.inputs import prefill_inputs, to_device
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.token_feed import NO_FEED

Drafts = Dict[str, Tuple[int, ...]]


class DraftModelRunner:
    """Runs the draft model beside the target's runner: ``draft`` gives each request that got
    tokens in a step its next ``num_speculative_tokens`` drafts."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.num_drafts = config.speculative.num_speculative_tokens
        # A row's drafts reach at most num_drafts positions past its blocks.
        self.scratch_per_row = -(-self.num_drafts // self.block_size)
        self.max_rows = config.scheduler.max_num_seqs
        self.steps = ModelSteps(model)
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.first_scratch = 0
        self._no_feed = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks the draft's cache holds beyond the shared ones."""
        return self.max_rows * self.scratch_per_row

    def bind_kv_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]], num_shared_blocks: int) -> None:
        """The draft's per-layer K/V pages: ``num_shared_blocks`` addressed by the target's
        block tables, then the scratch blocks."""
        self.kv_caches = kv_caches
        self.first_scratch = num_shared_blocks

    @torch.no_grad()
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The drafts that follow the tokens of each request of ``step.drafting`` once
        ``sampled`` (the step's tokens) are recorded; requests whose logits are processed get
        none (they never speculate). Every request's tokens enter the draft's cache."""
        pack = self._catch_up_pack(step, _tokens_by_request(sampled))
        inputs = prefill_inputs(pack, sum(len(w.token_ids) for w in pack),
                                sum(context_keys(w, self.block_size) for w in pack),
                                len(pack), self.block_size)
        wanted = set(step.drafting)
        rows = [i for i, w in enumerate(pack)
                if w.is_last_chunk and w.request_id in wanted and w.sampling.processing is None]
        # The LM head runs over the drafting rows only (its vocabulary-wide matmul is much of a
        # small draft model's cost).
        inputs["logits_indices"] = inputs["logits_indices"][rows]
        logits, _ = self.steps.prefill(**to_device(inputs, self.device), kv_caches=self.kv_caches)
        if not rows:
            return {}
        tokens = logits.argmax(-1)
        drafted = [tokens]
        positions = np.array([pack[i].num_context_tokens for i in rows], dtype=np.int64)
        tables = _padded_tables([pack[i].block_ids for i in rows])
        for _ in range(self.num_drafts - 1):
            tokens = self._decode(tokens, positions, tables)
            drafted.append(tokens)
            positions = positions + 1
        ids = torch.stack(drafted, dim=1).cpu().tolist()
        return {pack[i].request_id: tuple(row) for i, row in zip(rows, ids)}

    def _catch_up_pack(self, step: SchedulerOutput, new_tokens: Dict[str, List[int]]) -> List[PrefillWork]:
        """Per request of the step, the tokens of its text the draft has no K/V for: what the
        target computed that stays (a prompt chunk, a decode's or a verify's input token),
        then the step's new tokens. ``is_last_chunk``: the request drafts from its last one."""
        firsts = [(w, w.token_ids, w.start_pos) for w in step.prefills]
        firsts += [(w, (w.token_id,), w.position) for w in step.decodes]
        firsts += [(w, w.token_ids[:1], w.start_pos) for w in step.verifies]
        pack = []
        for row, (work, computed, start) in enumerate(firsts):
            new = new_tokens.get(work.request_id, ())
            scratch = range(self.first_scratch + row * self.scratch_per_row,
                            self.first_scratch + (row + 1) * self.scratch_per_row)
            pack.append(PrefillWork(work.request_id, tuple(computed) + tuple(new), start,
                                    tuple(work.block_ids) + tuple(scratch), work.sampling, bool(new)))
        return pack

    def _decode(self, tokens: torch.Tensor, positions: np.ndarray, tables: np.ndarray) -> torch.Tensor:
        """One greedy draft step: the rows' ``tokens`` at ``positions``; the next tokens."""
        rows = np.arange(len(positions))
        slots = tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        host = {"feed_slots": np.full(len(positions), NO_FEED, dtype=np.int64), "positions": positions,
                "slot_mapping": slots, "block_tables": tables, "context_lens": positions + 1}
        inputs = to_device({name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in host.items()}, self.device)
        logits = self.steps.decode(input_ids=tokens, feed_tokens=self._no_feed, kv_caches=self.kv_caches, **inputs)
        return logits.argmax(-1)


def _tokens_by_request(sampled: SampledTokens) -> Dict[str, List[int]]:
    """The step's new tokens of each request, in order (a verify gives several)."""
    tokens: Dict[str, List[int]] = {}
    for request_id, token_id in zip(sampled.request_ids, sampled.token_ids):
        tokens.setdefault(request_id, []).append(token_id)
    return tokens


def _padded_tables(tables: Sequence[Tuple[int, ...]]) -> np.ndarray:
    """Block tables as one array, short rows padded with the null block."""
    out = np.full((len(tables), max(len(t) for t in tables)), NULL_BLOCK, dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :len(table)] = table
    return out


def check_draft_checkpoint(target_path: str, draft_path: str) -> None:
    """Refuse a draft checkpoint whose tokens are not the target's: another vocabulary size,
    or (where both ship a ``tokenizer.json``) another vocabulary."""
    from tokenizers import Tokenizer

    from tpu_executor.worker.model_loader import load_hf_config

    if not os.path.isfile(os.path.join(draft_path, "config.json")):
        raise ValueError(f"speculative_config model {draft_path!r} is not a checkpoint directory (no config.json)")
    target_vocab = load_hf_config(target_path).vocab_size
    draft_vocab = load_hf_config(draft_path).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model {draft_path!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{target_vocab}: a draft model must share the target's tokenizer")
    files = [os.path.join(path, "tokenizer.json") for path in (target_path, draft_path)]
    if all(os.path.isfile(f) for f in files):
        target_tokens, draft_tokens = (Tokenizer.from_file(f).get_vocab() for f in files)
        if draft_tokens != target_tokens:
            raise ValueError(f"the draft model {draft_path!r} has another tokenizer than the target (their "
                             "tokenizer.json vocabularies differ): a draft model must share the target's tokenizer")
