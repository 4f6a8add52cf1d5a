"""Greedy verification of draft tokens (speculative decoding), on the device.

A verify pack is a prefill call over each request's last token and its drafts, reading the
earlier context from the pages; position ``i`` of a request's run gives the target's token
after the last token and the first ``i`` drafts. The verify graph (one per prefill token
bucket) takes the pack's hidden states at those positions through the LM head and returns the
target's greedy token at each, its log-prob and the top log-probs, as the sampler would for a
greedy row. The host then accepts the longest run of drafts equal to the target's tokens, and
the target's token after it (``accepted_rows``): the tokens one-at-a-time decoding gives.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

import torch

from tpu_executor.core.step import PrefillWork, SampledTokens


class VerifyOutput(NamedTuple):
    """The verify graph's outputs per position: greedy token, its log-prob, top ids and log-probs."""

    token_ids: torch.Tensor
    token_logprobs: torch.Tensor
    top_ids: Optional[torch.Tensor]
    top_logprobs: Optional[torch.Tensor]


def verify_step(model, hidden: torch.Tensor, rows: torch.Tensor, num_logprobs: int) -> VerifyOutput:
    """The target's greedy token at ``rows`` of ``hidden`` (runs compiled; ``num_logprobs``
    top log-probs, none when 0)."""
    logits = model.compute_logits(hidden.index_select(0, rows)).float()
    logprobs = torch.log_softmax(logits, dim=-1)
    token_ids = torch.argmax(logits, dim=-1)
    token_logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    if num_logprobs == 0:
        return VerifyOutput(token_ids, token_logprobs, None, None)
    top_logprobs, top_ids = torch.topk(logprobs, num_logprobs, dim=-1)
    return VerifyOutput(token_ids, token_logprobs, top_ids, top_logprobs)


def verify_rows(pack: Sequence[PrefillWork], num_rows: int) -> torch.Tensor:
    """The packed row's positions that the verify reads (every token of every work, in order),
    padded with position 0 to ``num_rows``."""
    count = sum(len(work.token_ids) for work in pack)
    rows = torch.zeros(num_rows, dtype=torch.int64)
    rows[:count] = torch.arange(count)
    return rows


class LaunchedVerify(NamedTuple):
    """A launched verify call: its pack and the verify graph's device outputs."""

    pack: Sequence[PrefillWork]
    out: VerifyOutput

    def collect(self) -> SampledTokens:
        """Each request's accepted drafts and the target's token after them, a row each
        (waits for the device)."""
        host = [None if t is None else t.cpu().tolist() for t in self.out]
        return accepted_rows(self.pack, *host)


def accepted_rows(pack: Sequence[PrefillWork], token_ids: List[int], logprobs: List[float],
                  top_ids: Optional[List[List[int]]], top_logprobs: Optional[List[List[float]]]) -> SampledTokens:
    """The rows a verified pack gives, from the target's tokens at each of its positions."""
    result = SampledTokens(top_logprobs=None if top_ids is None else [])
    offset = 0
    for work in pack:
        drafts = work.token_ids[1:]
        count = accepted_length(drafts, token_ids[offset:offset + len(drafts)])
        wanted = work.sampling.num_logprobs
        for row in range(offset, offset + count + 1):
            result.request_ids.append(work.request_id)
            result.token_ids.append(token_ids[row])
            result.logprobs.append(logprobs[row])
            if result.top_logprobs is not None:
                result.top_logprobs.append(None if wanted < 0 else dict(zip(top_ids[row][:wanted],
                                                                            top_logprobs[row][:wanted])))
        offset += len(work.token_ids)
    return result


def accepted_length(drafts: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (``target_ids[i]``: the target's
    token after the last token and ``drafts[:i]``)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_ids[accepted]:
        accepted += 1
    return accepted

