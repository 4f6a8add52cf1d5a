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
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.paged_drafter import PagedDrafter, StepText, step_slots
from tpu_executor.worker.token_feed import NO_FEED


class DraftModelRunner(PagedDrafter):
    """Runs the draft model beside the target's runner (``draft_model``)."""

    kind = "draft model"

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, runtime=None):
        super().__init__(config, model, device, runtime)
        self.steps = ModelSteps(model)
        self._catch_up_fn = self.compiled(partial(catch_up_drafts, self.steps))
        self._steps_fn = self.compiled(partial(greedy_draft_steps, self.steps, num_steps=self.num_drafts - 1,
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


def catch_up_drafts(steps: ModelSteps, kv_caches, **inputs) -> torch.Tensor:
    """The draft model over a catch-up pack (a prefill call's inputs): the greedy token after
    each row (a row that ends with its request's newest token gives the first draft)."""
    logits, _ = steps.prefill(kv_caches=kv_caches, **inputs)
    return logits.argmax(-1)


def greedy_draft_steps(steps: ModelSteps, first_drafts: torch.Tensor, positions: torch.Tensor,
                       block_tables: torch.Tensor, kv_caches, num_steps: int, block_size: int) -> torch.Tensor:
    """``num_steps`` greedy decode steps of the draft model, unrolled in one call, after each
    row's first draft at ``positions``: the rows' next drafts."""
    no_feed = torch.full_like(first_drafts, NO_FEED)
    feed = torch.zeros(1, dtype=first_drafts.dtype, device=first_drafts.device)
    tokens, drafts = first_drafts, []
    for step in range(num_steps):
        slots, context_lens = step_slots(positions + step, block_tables, block_size)
        logits = steps.decode(input_ids=tokens, feed_slots=no_feed, feed_tokens=feed, positions=positions + step,
                              slot_mapping=slots, block_tables=block_tables, context_lens=context_lens,
                              kv_caches=kv_caches)
        tokens = logits.argmax(-1)
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
