"""Host-side input tensors of one model call, padded to a bucket of the plan.

A prefill call packs up to ``max_prefill_seqs`` prompts (or prompt chunks) into one row of
``num_tokens`` queries over ``num_keys`` context keys; a decode call is ``rows`` sequences with ``context_blocks``-wide block tables. Padding tokens
write their K/V to the null block and padding keys share segment -1, so they never mix with
real ones. Every tensor has the bucket's fixed shape, whatever the real sizes.

The arrays are built with numpy from whole columns at once (one list per field, block tables
filled through one mask) and handed to torch without a copy: per-row ``torch.tensor`` calls
cost ~10 us each, which at hundreds of sequences is milliseconds of host time per step.
"""
from __future__ import annotations

import itertools
from types import MappingProxyType
from typing import Dict, Mapping, Sequence

import numpy as np
import torch

from tpu_executor.core.buckets import context_keys
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, PrefillWork, SamplingMeta
from tpu_executor.worker.token_feed import NO_FEED


def _slots(block_ids: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def _as_tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def prefill_inputs(pack: Sequence[PrefillWork], num_tokens: int, num_keys: int, max_seqs: int,
                   block_size: int) -> Dict[str, torch.Tensor]:
    """Several sequences' new tokens (whole prompts or chunks) packed into one ``num_tokens``
    row, with their contexts (cached, earlier chunks, new) as ``num_keys`` keys, each context
    in whole pages. Padding queries and keys share segment -1."""
    t = {name: np.zeros(size, dtype=np.int64) for name, size in
         (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
          ("context_slots", num_keys), ("key_positions", num_keys))}
    t["query_segments"] = np.full(num_tokens, -1, dtype=np.int64)
    t["key_segments"] = np.full(num_keys, -1, dtype=np.int64)
    t["logits_indices"] = np.zeros(max_seqs, dtype=np.int64)
    query_at = key_at = 0
    for segment, item in enumerate(pack):
        num_new, num_ctx, num_keys = len(item.token_ids), item.num_context_tokens, context_keys(item, block_size)
        q, k = slice(query_at, query_at + num_new), slice(key_at, key_at + num_keys)
        t["input_ids"][q] = item.token_ids
        t["positions"][q] = np.arange(item.start_pos, num_ctx)
        t["slot_mapping"][q] = _slots(item.block_ids, t["positions"][q], block_size)
        t["query_segments"][q] = segment
        # Keys fill the context's last page to its end (the kernel reads whole pages); the
        # fill keys are padding (segment -1) but keep their page's slots.
        page_positions = np.arange(num_keys)
        t["context_slots"][k] = _slots(item.block_ids, page_positions, block_size)
        t["key_positions"][k] = np.where(page_positions < num_ctx, page_positions, 0)
        t["key_segments"][k] = np.where(page_positions < num_ctx, segment, -1)
        t["logits_indices"][segment] = query_at + num_new - 1
        query_at, key_at = query_at + num_new, key_at + num_keys
    return _as_tensors(t)


def decode_inputs(work: Sequence[DecodeWork], rows: int, context_blocks: int, block_size: int,
                  pending_slots: Mapping[str, int] = MappingProxyType({})) -> Dict[str, torch.Tensor]:
    """A decode batch padded to ``rows`` rows and ``context_blocks`` block-table entries. A
    ``PENDING_TOKEN`` input is the token the previous step sampled for the same request, still
    on the device: ``feed_slots`` names its slot in the token feed (``pending_slots``) and the
    decode graph reads it from there. A request of a failed previous step has no slot and
    gets token 0 (the engine has failed that request and discards what it computes)."""
    num = len(work)
    input_ids = np.zeros(rows, dtype=np.int64)
    positions = np.zeros(rows, dtype=np.int64)
    feed_slots = np.full(rows, NO_FEED, dtype=np.int64)
    token_ids = [item.token_id for item in work]
    if PENDING_TOKEN in token_ids:
        feed_slots[:num] = [pending_slots.get(item.request_id, NO_FEED) if item.token_id == PENDING_TOKEN
                            else NO_FEED for item in work]
        token_ids = [max(token_id, 0) for token_id in token_ids]
    input_ids[:num] = token_ids
    positions[:num] = [item.position for item in work]
    table_lens = np.fromiter((len(item.block_ids) for item in work), dtype=np.int64, count=num)
    tables = np.full((rows, context_blocks), NULL_BLOCK, dtype=np.int64)
    # Row-major order of the mask is the order of the concatenated block lists.
    tables[:num][np.arange(context_blocks)[None, :] < table_lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(item.block_ids for item in work), dtype=np.int64, count=int(table_lens.sum()))
    slots = np.full(rows, NULL_BLOCK * block_size, dtype=np.int64)
    real = positions[:num]
    slots[:num] = tables[np.arange(num), real // block_size] * block_size + real % block_size
    return _as_tensors({"input_ids": input_ids, "feed_slots": feed_slots, "positions": positions,
                        "slot_mapping": slots, "block_tables": tables, "context_lens": positions + 1})


# (tensor name, SamplingMeta field, dtype); padding rows take SamplingMeta.greedy()'s values.
_SAMPLING_COLUMNS = (("temperature", "temperature", np.float32), ("top_k", "top_k", np.int64),
                     ("top_p", "top_p", np.float32), ("min_p", "min_p", np.float32),
                     ("seeds", "seed", np.int64))
_GREEDY = SamplingMeta.greedy()


def sampling_tensors(work: Sequence, rows: int) -> Dict[str, torch.Tensor]:
    """Per-row sampler inputs of ``work`` (prefill or decode items) padded to ``rows`` rows
    (padding rows are greedy). A row's step is its sampled token's index among the outputs."""
    num = len(work)
    arrays = {name: np.full(rows, getattr(_GREEDY, field), dtype=dtype) for name, field, dtype in _SAMPLING_COLUMNS}
    arrays["steps"] = np.zeros(rows, dtype=np.int64)
    if num:
        # zip(*...) turns the rows into columns in C: no Python step per row and field.
        columns = dict(zip(SamplingMeta._fields, zip(*[item.sampling for item in work])))
        for name, field, _ in _SAMPLING_COLUMNS:
            arrays[name][:num] = columns[field]
        sampled_positions = np.array([item.sampled_position for item in work], dtype=np.int64)
        arrays["steps"][:num] = sampled_positions - np.array(columns["prompt_len"], dtype=np.int64)
    return _as_tensors(arrays)


def to_device(tensors: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, torch.Tensor]:
    """The host tensors of one call on ``device``. On XLA they go in one batched transfer:
    one ``.to()`` per tensor costs a round through the runtime each (about 35 us here, for a
    dozen tensors per call)."""
    if device.type == "xla":
        import torch_xla.core.xla_model as xm  # only on the XLA path

        return xm.send_cpu_data_to_device(tensors, device)
    return {name: t.to(device) for name, t in tensors.items()}
