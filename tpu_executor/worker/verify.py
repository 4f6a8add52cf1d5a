"""Verification of draft tokens (speculative decoding), on the device.

A verify pack is a prefill call over each request's last token and its drafts, reading the
earlier context from the pages; position ``i`` of a request's run is where the target picks its
token after the last token and the first ``i`` drafts. The verify graph (one per prefill token
bucket) takes the pack's hidden states at those positions through the LM head and the sampler,
each position a row with its request's sampling parameters and its own seeding step, so a
position draws exactly the token decoding one at a time would draw there. The host accepts the
longest run of drafts equal to those tokens, then the token after it (``accepted_rows``).

For a drafter whose draft is one token with certainty (n-gram), this is rejection sampling: a
draft ``x`` is accepted with probability ``p(x) = min(1, p(x) / q(x))``, and on rejection the
token drawn is distributed as ``p`` without ``x``, renormalised, which is ``max(0, p - q)``
renormalised. Greedy rows accept the drafts equal to the argmax.
"""
from __future__ import annotations

from typing import List, NamedTuple, Sequence

import torch

from tpu_executor.core.step import PrefillWork, SamplingMeta
from tpu_executor.worker.sampler import SamplerOutput, sample


class VerifyPosition(NamedTuple):
    """One verified position as the sampler's inputs see a work item: its request's sampling
    row and the position of the token it picks (its seeding step)."""

    sampling: SamplingMeta
    sampled_position: int


def verify_positions(pack: Sequence[PrefillWork]) -> List[VerifyPosition]:
    """Every position of every verify of ``pack``, in order."""
    return [VerifyPosition(work.sampling, work.start_pos + i + 1) for work in pack for i in range(len(work.token_ids))]


def verify_step(model, hidden: torch.Tensor, rows: torch.Tensor, num_logprobs: int, all_greedy: bool,
                **sampling) -> SamplerOutput:
    """The token the sampler picks at ``rows`` of ``hidden``, with their log-probs (runs
    compiled; ``sampling``: the rows' sampler inputs, ``worker/inputs.py``)."""
    logits = model.compute_logits(hidden.index_select(0, rows))
    return sample(logits, num_logprobs=num_logprobs, all_greedy=all_greedy, **sampling)


def verify_rows(pack: Sequence[PrefillWork], num_rows: int) -> torch.Tensor:
    """The packed row's positions that the verify reads (every token of every work, in order),
    padded with position 0 to ``num_rows``."""
    count = sum(len(work.token_ids) for work in pack)
    rows = torch.zeros(num_rows, dtype=torch.int64)
    rows[:count] = torch.arange(count)
    return rows


def accepted_rows(pack: Sequence[PrefillWork], token_ids: List[int]) -> List[int]:
    """The rows a verified pack keeps, of its positions' drawn ``token_ids``: each request's
    accepted drafts, then the token drawn after them."""
    kept, offset = [], 0
    for work in pack:
        drafts = work.token_ids[1:]
        count = accepted_length(drafts, token_ids[offset:offset + len(drafts)])
        kept.extend(range(offset, offset + count + 1))
        offset += len(work.token_ids)
    return kept


def accepted_length(drafts: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (``target_ids[i]``: the target's
    token after the last token and ``drafts[:i]``)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_ids[accepted]:
        accepted += 1
    return accepted

