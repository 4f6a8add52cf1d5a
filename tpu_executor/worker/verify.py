"""Verification of draft tokens (speculative decoding), on the device.

Position ``i`` of a request's verify is where the target picks its token after the last token
and the first ``i`` drafts. On the bucketed paths a step with verifies runs a verify graph: a
decode graph whose sequences (the decodes and the verifies) have k + 1 query tokens each,
attending over their pages in one read, each query up to its own position (a layer writes
every row's K/V before any row attends); the sampler graph over the real rows picks the tokens. At
exact sizes (the native path) a verify pack is one prefill call over every request's last token
and drafts, its positions through the LM head and the sampler. Either way each position is a
row with its request's sampling parameters and its own seeding step, so a position draws
exactly the token decoding one at a time would draw there. The host accepts the
longest run of drafts equal to those tokens, then the token after it (``accepted_rows``).

For a drafter whose draft is one token with certainty (n-gram), this is rejection sampling: a
draft ``x`` is accepted with probability ``p(x) = min(1, p(x) / q(x))``, and on rejection the
token drawn is distributed as ``p`` without ``x``, renormalised, which is ``max(0, p - q)``
renormalised. Greedy rows accept the drafts equal to the argmax.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np
import torch

from tpu_executor.core.buckets import DecodeGraph
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PrefillWork, SamplingMeta
from tpu_executor.worker.inputs import table_slots
from tpu_executor.worker.sampler import SamplerOutput, sample
from tpu_executor.worker.token_feed import NO_FEED


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


def verify_query_inputs(decodes: Optional[Dict[str, torch.Tensor]], pack: Sequence[PrefillWork],
                        graph: DecodeGraph, block_size: int, lora: bool = False) -> Dict[str, torch.Tensor]:
    """A verify graph's inputs (``DecodeGraph`` with ``queries`` tokens a sequence): the decode
    rows' ``decodes`` (``PersistentDecodeBatch.inputs``, one token each; None: no decodes), then the verifies
    of ``pack`` (a last token and drafts each), every sequence's tokens at the end of its
    ``queries`` rows; padding rows write the null block (with ``lora``, each row's adapter
    slot too: ``lora_slots``). ``sample_rows`` lists the real rows
    in that order (padded with row 0): the rows whose logits the graph returns."""
    queries, num_decodes = graph.queries, 0 if decodes is None else len(decodes["input_ids"])
    per_token = ("input_ids", "positions", "lora_slots") if lora else ("input_ids", "positions")
    tokens = {name: np.zeros(graph.num_tokens, dtype=np.int64) for name in per_token}
    tokens["feed_slots"] = np.full(graph.num_tokens, NO_FEED, dtype=np.int64)
    tokens["slot_mapping"] = np.full(graph.num_tokens, NULL_BLOCK * block_size, dtype=np.int64)
    tables = np.full((graph.num_rows, graph.context_blocks), NULL_BLOCK, dtype=np.int64)
    lens = np.ones(graph.num_rows, dtype=np.int64)  # a padding sequence sees key 0 of the null block
    decode_rows = np.arange(num_decodes) * queries + queries - 1
    if num_decodes:
        for name in tokens:
            tokens[name][decode_rows] = decodes[name].numpy()
        tables[:num_decodes], lens[:num_decodes] = decodes["block_tables"].numpy(), decodes["context_lens"].numpy()
    sample_rows = [decode_rows]
    for seq, work in enumerate(pack, start=num_decodes):
        num, blocks = len(work.token_ids), work.block_ids[:graph.context_blocks]
        rows = np.arange(seq * queries + queries - num, (seq + 1) * queries)
        positions = np.arange(work.start_pos, work.start_pos + num)
        tables[seq, :len(blocks)] = blocks
        lens[seq] = work.start_pos + num
        tokens["input_ids"][rows], tokens["positions"][rows] = work.token_ids, positions
        tokens["slot_mapping"][rows] = table_slots(tables[[seq] * num], positions, block_size)
        if lora:
            tokens["lora_slots"][rows] = work.lora_slot
        sample_rows.append(rows)
    picked = np.zeros(graph.num_tokens, dtype=np.int64)
    real = np.concatenate(sample_rows)
    picked[:len(real)] = real
    arrays = {**tokens, "block_tables": tables, "context_lens": lens, "sample_rows": picked}
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


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

