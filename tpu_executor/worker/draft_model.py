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

import abc
import contextlib
import os
from typing import ContextManager, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np
import torch

from tpu_executor.core.buckets import context_keys
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PrefillWork, SampledTokens, SchedulerOutput
from tpu_executor.worker.inputs import prefill_inputs, table_slots, to_device
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.token_feed import NO_FEED

Drafts = Dict[str, Tuple[int, ...]]


class StepText(NamedTuple):
    """A request's tokens from ``start``: ``computed`` by the target in the step (those that
    stay in its text), then the step's ``new`` ones."""

    work: object  # the step's PrefillWork or DecodeWork of the request
    start: int
    computed: Tuple[int, ...]
    new: Tuple[int, ...]


class PagedDrafter(abc.ABC):
    """What the drafters in the worker share: a model with its own KV cache in the target's
    block layout, scratch blocks past the shared ones for draft positions, and the greedy
    decode steps that make drafts 2 to k. ``draft`` gives each request of ``step.drafting``
    its next ``num_speculative_tokens`` drafts once the step's tokens are known."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.num_drafts = config.speculative.num_speculative_tokens
        # A row's drafts reach at most num_drafts positions past its blocks.
        self.scratch_per_row = -(-self.num_drafts // self.block_size)
        self.max_rows = config.scheduler.max_num_seqs
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.first_scratch = 0

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks the draft's cache holds beyond the shared ones."""
        return self.max_rows * self.scratch_per_row

    def bind_kv_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]], num_shared_blocks: int) -> None:
        """The draft's per-layer K/V pages: ``num_shared_blocks`` addressed by the target's
        block tables, then the scratch blocks."""
        self.kv_caches = kv_caches
        self.first_scratch = num_shared_blocks

    def capture(self) -> ContextManager:
        """Entered around the target's step: what the drafter reads of the target's call."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The next drafts of each request of ``step.drafting``, once ``sampled`` (the step's
        tokens) are recorded."""

    def _pack_inputs(self, pack: Sequence[PrefillWork]) -> Dict[str, torch.Tensor]:
        """The catch-up pack's host inputs at its exact size."""
        return prefill_inputs(pack, sum(len(w.token_ids) for w in pack),
                              sum(context_keys(w, self.block_size) for w in pack), len(pack), self.block_size)

    def _step_texts(self, step: SchedulerOutput, sampled: SampledTokens) -> List[StepText]:
        """Per request of the step, its text from the first position the target computed:
        what the target computed that stays (a prompt chunk, a decode's input token, a
        verify's input token: its accepted drafts are among the new tokens), then the new ones."""
        new_tokens = _tokens_by_request(sampled)
        firsts = [(w, w.token_ids, w.start_pos) for w in step.prefills]
        firsts += [(w, (w.token_id,), w.position) for w in step.decodes]
        firsts += [(w, w.token_ids[:1], w.start_pos) for w in step.verifies]
        return [StepText(w, start, tuple(computed), tuple(new_tokens.get(w.request_id, ())))
                for w, computed, start in firsts]

    def _row_work(self, row: int, work, tokens: Tuple[int, ...], start: int, drafts: bool) -> PrefillWork:
        """Row ``row`` of the catch-up pack: ``tokens`` at ``start``, over the request's blocks and
        the row's scratch blocks; ``drafts`` (as ``is_last_chunk``): the row's last position drafts."""
        first = self.first_scratch + row * self.scratch_per_row
        blocks = tuple(work.block_ids) + tuple(range(first, first + self.scratch_per_row))
        return PrefillWork(work.request_id, tokens, start, blocks, work.sampling, drafts)

    def _drafting_rows(self, step: SchedulerOutput, pack: Sequence[PrefillWork]) -> List[int]:
        """The pack's rows that draft: those of ``step.drafting`` with a new token and no
        logits processing (those never speculate)."""
        wanted = set(step.drafting)
        return [i for i, w in enumerate(pack)
                if w.is_last_chunk and w.request_id in wanted and w.sampling.processing is None]

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
        tables = _padded_tables([pack[i].block_ids for i in rows])
        for _ in range(self.num_drafts - 1):
            drafted.append(step_fn(drafted[-1], self._decode_metadata(positions, tables)))
            positions = positions + 1
        ids = torch.stack(drafted, dim=1).cpu().tolist()
        return {pack[i].request_id: tuple(row) for i, row in zip(rows, ids)}


class DraftModelRunner(PagedDrafter):
    """Runs the draft model beside the target's runner (``draft_model``)."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        super().__init__(config, model, device)
        self.steps = ModelSteps(model)
        self._no_feed = torch.zeros(1, dtype=torch.int64, device=device)

    @torch.no_grad()
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The drafts that follow the tokens of each request of ``step.drafting`` once
        ``sampled`` (the step's tokens) are recorded. Every request's tokens enter the draft's
        cache; a request drafts from its last one."""
        pack = [self._row_work(row, text.work, text.computed + text.new, text.start, bool(text.new))
                for row, text in enumerate(self._step_texts(step, sampled))]
        inputs = self._pack_inputs(pack)
        rows = self._drafting_rows(step, pack)
        # The LM head runs over the drafting rows only (its vocabulary-wide matmul is much of a
        # small draft model's cost).
        inputs["logits_indices"] = inputs["logits_indices"][rows]
        logits, _ = self.steps.prefill(**to_device(inputs, self.device), kv_caches=self.kv_caches)
        if not rows:
            return {}
        return self._draft_steps(logits.argmax(-1), pack, rows, self._decode)

    def _decode(self, tokens: torch.Tensor, metadata: Dict[str, torch.Tensor]) -> torch.Tensor:
        """One greedy draft step: the tokens after ``tokens``."""
        no_feed = torch.full_like(tokens, NO_FEED)
        logits = self.steps.decode(input_ids=tokens, feed_slots=no_feed, feed_tokens=self._no_feed,
                                   kv_caches=self.kv_caches, **metadata)
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
