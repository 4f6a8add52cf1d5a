"""Host-side input tensors of one model call, padded to a bucket of the plan.

A prefill call packs up to ``max_prefill_seqs`` prompts into one row of ``bucket`` tokens; a
decode call is ``rows`` sequences with ``context_blocks``-wide block tables. Padding tokens
write their K/V to the null block and padding keys share segment -1, so they never mix with
real ones. Every tensor has the bucket's fixed shape, whatever the real sizes.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch

from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import DecodeWork, PrefillWork, SamplingMeta


def _slots(block_ids: Sequence[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_ids, dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def prefill_inputs(pack: Sequence[PrefillWork], bucket: int, max_seqs: int, block_size: int) -> Dict[str, torch.Tensor]:
    """Several sequences' new tokens packed into one ``bucket``-long row, with their contexts
    (prefix-cached and new) as the keys. Padding queries and keys share segment -1."""
    t = {name: torch.zeros(bucket, dtype=torch.int64) for name in
         ("input_ids", "positions", "slot_mapping", "context_slots", "key_positions")}
    t["query_segments"] = torch.full((bucket,), -1, dtype=torch.int64)
    t["key_segments"] = torch.full((bucket,), -1, dtype=torch.int64)
    t["logits_indices"] = torch.zeros(max_seqs, dtype=torch.int64)
    query_at = key_at = 0
    for segment, item in enumerate(pack):
        num_new, num_ctx = len(item.token_ids), item.num_context_tokens
        q, k = slice(query_at, query_at + num_new), slice(key_at, key_at + num_ctx)
        t["input_ids"][q] = torch.tensor(item.token_ids, dtype=torch.int64)
        t["positions"][q] = torch.arange(item.start_pos, num_ctx)
        t["slot_mapping"][q] = _slots(item.block_ids, t["positions"][q], block_size)
        t["query_segments"][q] = segment
        t["key_positions"][k] = torch.arange(num_ctx)
        t["context_slots"][k] = _slots(item.block_ids, t["key_positions"][k], block_size)
        t["key_segments"][k] = segment
        t["logits_indices"][segment] = query_at + num_new - 1
        query_at, key_at = query_at + num_new, key_at + num_ctx
    return t


def decode_inputs(work: Sequence[DecodeWork], rows: int, context_blocks: int, block_size: int) -> Dict[str, torch.Tensor]:
    """A decode batch padded to ``rows`` rows and ``context_blocks`` block-table entries."""
    input_ids = torch.zeros(rows, dtype=torch.int64)
    positions = torch.zeros(rows, dtype=torch.int64)
    slots = torch.full((rows,), NULL_BLOCK * block_size, dtype=torch.int64)
    tables = torch.full((rows, context_blocks), NULL_BLOCK, dtype=torch.int64)
    for row, item in enumerate(work):
        input_ids[row] = item.token_id
        positions[row] = item.position
        tables[row, :len(item.block_ids)] = torch.tensor(item.block_ids, dtype=torch.int64)
        slots[row] = item.block_ids[item.position // block_size] * block_size + item.position % block_size
    return {"input_ids": input_ids, "positions": positions, "slot_mapping": slots,
            "block_tables": tables, "context_lens": positions + 1}


def sampling_tensors(metas: Sequence[SamplingMeta], rows: int) -> Dict[str, torch.Tensor]:
    """Per-row sampler inputs padded to ``rows`` rows (padding rows are greedy)."""
    padded = list(metas) + [SamplingMeta.greedy()] * (rows - len(metas))
    return {
        "temperature": torch.tensor([m.temperature for m in padded], dtype=torch.float32),
        "top_k": torch.tensor([m.top_k for m in padded], dtype=torch.int64),
        "top_p": torch.tensor([m.top_p for m in padded], dtype=torch.float32),
        "min_p": torch.tensor([m.min_p for m in padded], dtype=torch.float32),
        "seeds": torch.tensor([m.seed for m in padded], dtype=torch.int64),
        "steps": torch.tensor([m.step for m in padded], dtype=torch.int64),
    }


def to_device(tensors: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    return {name: t.to(device) for name, t in tensors.items()}
