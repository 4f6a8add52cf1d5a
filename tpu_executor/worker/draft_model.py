"""The draft model of speculative decoding (``draft_model``): a smaller model with the target's
tokenizer, run beside the target as a ``PagedDrafter`` (``worker/paged_drafter.py``). Its
catch-up over each step's tokens is a packed prefill of the draft model; drafts 2 to k are its
greedy decode steps.
"""
from __future__ import annotations

import os
from functools import partial
from typing import Dict, List, Optional, Sequence

import torch

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.step import PrefillWork
from tpu_executor.worker.paged_drafter import PagedDrafter, StepText, attention_metadata, step_slots


class DraftModelRunner(PagedDrafter):
    """Runs the draft model beside the target's runner (``draft_model``)."""

    kind = "draft model"

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, runtime=None):
        super().__init__(config, model, device, runtime)
        self._catch_up_fn = self.compiled(partial(catch_up_drafts, model))
        self._steps_fn = self.compiled(partial(greedy_draft_steps, model, num_steps=self.num_drafts - 1,
                                               block_size=self.block_size))

    def _catch_up_pack(self, texts: Sequence[StepText], max_model_len: int) -> List[PrefillWork]:
        """Per request, the tokens the target computed that stay, then the new ones; a
        request drafts from its last token."""
        pack = []
        for row, text in enumerate(texts):
            tokens = (text.computed + text.new)[:max_model_len - text.start]
            drafts = bool(text.new) and len(tokens) == len(text.computed) + len(text.new)
            pack.append(self._row_work(row, text.work, tokens, text.start, drafts))
        return pack

    def _run_catch_up(self, inputs: Dict[str, torch.Tensor], logit_rows: Sequence[Optional[int]]) -> torch.Tensor:
        return self._catch_up_fn(**self.runner.put(inputs), kv_caches=self.kv_caches)

    def _run_steps(self, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self._steps_fn(**self.runner.put(inputs), kv_caches=self.kv_caches)


def catch_up_drafts(model, input_ids, positions, slot_mapping, logits_indices, kv_caches, **attention) -> torch.Tensor:
    """The draft model over a catch-up call (``attention``: a prefill pack's keys or decode
    rows' block tables): the greedy token after each of ``logits_indices`` (a row that ends
    with its request's newest token gives the first draft)."""
    hidden = model(input_ids, kv_caches, attention_metadata(positions, slot_mapping, **attention))
    return model.compute_logits(hidden[logits_indices]).argmax(-1)


def greedy_draft_steps(model, first_drafts: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                       kv_caches, num_steps: int, block_size: int) -> torch.Tensor:
    """``num_steps`` greedy decode steps of the draft model, unrolled in one call, after each
    row's first draft at ``positions``: the rows' next drafts."""
    tokens, drafts = first_drafts, []
    for step in range(num_steps):
        slots, context_lens = step_slots(positions + step, block_tables, block_size)
        meta = attention_metadata(positions + step, slots, block_tables=block_tables, context_lens=context_lens)
        tokens = model.compute_logits(model(tokens, kv_caches, meta)).argmax(-1)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)


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
