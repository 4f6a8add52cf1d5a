"""The drafters of speculative decoding, as the scheduler asks them for drafts: the n-gram
drafter (prompt lookup, on the host) and the draft model's (its drafts come with each step's
output from the worker, ``worker/draft_model.py``).

The n-gram drafter:

For a request it looks for the sequence's last ``n`` tokens earlier in its prompt and outputs,
``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, and drafts the tokens that
followed its most recent earlier occurrence with room for a full draft: text that repeats or
edits what came before (code edits, quoting, summaries) drafts itself. Each ``n`` is one
vectorised comparison over the sequence, no Python loop over its tokens.

Requests with logits processing (penalties, bias, masks, grammars) do not speculate: the
processed logits at a draft position depend on the drafts before it. They decode beside the
others, as without speculation.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

import numpy as np

from tpu_executor.core.request import Request
from tpu_executor.core.speculative import MODEL_METHODS, SpeculativeConfig

logger = logging.getLogger(__name__)


class _BatchLimit:
    """Speculation is off above ``disable_by_batch_size`` running sequences. A drafter that
    fails for a request costs that request its drafts for the step (it decodes, as without
    speculation), never the step or the engine: a WARNING says why."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def active(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, request: Request, max_drafts: int) -> Tuple[int, ...]:
        """Up to ``max_drafts`` drafts for ``request``: the subclass's ``_propose``, guarded."""
        try:
            return self._propose(request, max_drafts)
        except Exception:  # noqa: BLE001 - drafts are an optimisation: the request decodes
            logger.warning("drafting for request %s failed; it decodes without drafts this step",
                           request.request_id, exc_info=True)
            return ()


class ModelDrafter(_BatchLimit):
    """The draft model's drafts for the scheduler (``core.speculative.Drafter``): those the
    worker made after the request's latest token (``Request.drafts``), if any."""

    drafts_in_worker = True

    def _propose(self, request: Request, max_drafts: int) -> Tuple[int, ...]:
        if request.sampling.processing is not None or request.drafted_at != request.num_tokens:
            return ()
        return request.drafts[:max_drafts]


class NgramDrafter(_BatchLimit):
    """Drafts by prompt lookup for the scheduler (``core.speculative.Drafter``)."""

    drafts_in_worker = False

    def _propose(self, request: Request, max_drafts: int) -> Tuple[int, ...]:
        if request.sampling.processing is not None:
            return ()
        config = self.config
        return ngram_drafts(request.all_token_ids, min(max_drafts, config.num_speculative_tokens),
                            config.prompt_lookup_min, config.prompt_lookup_max)


def ngram_drafts(token_ids: Sequence[int], max_drafts: int, min_n: int, max_n: int) -> Tuple[int, ...]:
    """Up to ``max_drafts`` tokens that followed an earlier occurrence of the sequence's last
    ``n`` tokens, for the largest ``n`` in ``[min_n, max_n]`` that occurs (the latest occurrence
    that ``max_drafts`` tokens follow, else the earliest); none when no such suffix recurs."""
    num = len(token_ids)
    if max_drafts <= 0 or num <= min_n:
        return ()
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # Windows starting at 0 .. num - n - 1: every earlier occurrence, the suffix itself excluded.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            # The latest occurrence followed by a full draft, else the earliest (the longest).
            full = hits[hits + n + max_drafts <= num]
            start = int(full[-1] if full.size else hits[0]) + n
            return tuple(tokens[start:start + max_drafts].tolist())
    return ()


def make_drafter(config: Optional[SpeculativeConfig]) -> Optional[_BatchLimit]:
    """The drafter of ``config``'s method, None without speculation."""
    if config is None:
        return None
    return ModelDrafter(config) if config.method in MODEL_METHODS else NgramDrafter(config)
