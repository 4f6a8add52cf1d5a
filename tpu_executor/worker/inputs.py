"""Host-side input tensors of a prefill call and of the sampler, padded to a bucket of the
plan (a decode call's come from the persistent batch, ``worker/decode_batch.py``; a mixed
call joins the two).

A prefill call packs up to ``max_prefill_seqs`` prompts (or prompt chunks) into one row of
``num_tokens`` queries over ``num_keys`` context keys. Padding tokens write their K/V to the
null block and padding keys share segment -1, so they never mix with real ones. Every tensor
has the bucket's fixed shape, whatever the real sizes.

The arrays are built with numpy from whole columns at once (one list per field) and handed to
torch without a copy: per-row ``torch.tensor`` calls cost ~10 us each, which at hundreds of
sequences is milliseconds of host time per step.
"""
from __future__ import annotations

import math
from typing import Dict, Sequence

import numpy as np
import torch

from tpu_executor.core.buckets import context_keys
from tpu_executor.core.step import PrefillWork, SamplingMeta
from tpu_executor.worker.logits_processing import row_arrays


def _slots(block_ids: Sequence[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    blocks = np.asarray(block_ids, dtype=np.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def table_slots(tables: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The KV slot of each row's position: row ``i`` of ``tables`` is that row's block table."""
    return tables[np.arange(len(positions)), positions // block_size] * block_size + positions % block_size


def _as_tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def prefill_inputs(pack: Sequence[PrefillWork], num_tokens: int, num_keys: int, max_seqs: int,
                   block_size: int, lora: bool = False) -> Dict[str, torch.Tensor]:
    """Several sequences' new tokens (whole prompts or chunks) packed into one ``num_tokens``
    row, with their contexts (cached, earlier chunks, new) as ``num_keys`` keys, each context
    in whole pages. Padding queries and keys share segment -1. With ``lora``, each token's
    adapter slot too (``lora_slots``; padding: 0, the base model)."""
    t = {name: np.zeros(size, dtype=np.int64) for name, size in
         (("input_ids", num_tokens), ("positions", num_tokens), ("slot_mapping", num_tokens),
          ("context_slots", num_keys), ("key_positions", num_keys))}
    t["query_segments"] = np.full(num_tokens, -1, dtype=np.int64)
    t["key_segments"] = np.full(num_keys, -1, dtype=np.int64)
    t["logits_indices"] = np.zeros(max_seqs, dtype=np.int64)
    if lora:
        t["lora_slots"] = np.zeros(num_tokens, dtype=np.int64)
    query_at = key_at = 0
    for segment, item in enumerate(pack):
        num_new, num_ctx, num_keys = len(item.token_ids), item.num_context_tokens, context_keys(item, block_size)
        q, k = slice(query_at, query_at + num_new), slice(key_at, key_at + num_keys)
        t["input_ids"][q] = item.token_ids
        t["positions"][q] = np.arange(item.start_pos, num_ctx)
        t["slot_mapping"][q] = _slots(item.block_ids, t["positions"][q], block_size)
        t["query_segments"][q] = segment
        if lora:
            t["lora_slots"][q] = item.lora_slot
        # Keys fill the context's last page to its end (the kernel reads whole pages); the
        # fill keys are padding (segment -1) but keep their page's slots.
        page_positions = np.arange(num_keys)
        t["context_slots"][k] = _slots(item.block_ids, page_positions, block_size)
        t["key_positions"][k] = np.where(page_positions < num_ctx, page_positions, 0)
        t["key_segments"][k] = np.where(page_positions < num_ctx, segment, -1)
        t["logits_indices"][segment] = query_at + num_new - 1
        query_at, key_at = query_at + num_new, key_at + num_keys
    return _as_tensors(t)


def mixed_inputs(prefill: Dict[str, torch.Tensor], decode: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """A prefill call's inputs and a decode call's as one mixed call's: the per-token tensors
    joined, the pack's tokens first; the others as they are."""
    joined = {name: torch.cat([prefill[name], decode[name]])
              for name in ("input_ids", "positions", "slot_mapping", "lora_slots") if name in prefill}
    return {**prefill, **decode, **joined}


# (tensor name, SamplingMeta field, dtype); padding rows take SamplingMeta.greedy()'s values.
SAMPLING_COLUMNS = (("temperature", "temperature", np.float32), ("top_k", "top_k", np.int64),
                     ("top_p", "top_p", np.float32), ("min_p", "min_p", np.float32),
                     ("seeds", "seed", np.int64))
_GREEDY = SamplingMeta.greedy()


def sampling_tensors(work: Sequence, rows: int) -> Dict[str, torch.Tensor]:
    """Per-row sampler inputs of ``work`` (prefill or decode items) padded to ``rows`` rows
    (padding rows are greedy). A row's step is its sampled token's index among the outputs."""
    num = len(work)
    arrays = {name: np.full(rows, getattr(_GREEDY, field), dtype=dtype) for name, field, dtype in SAMPLING_COLUMNS}
    arrays["steps"] = np.zeros(rows, dtype=np.int64)
    if num:
        # zip(*...) turns the rows into columns in C: no Python step per row and field.
        columns = dict(zip(SamplingMeta._fields, zip(*[item.sampling for item in work])))
        for name, field, _ in SAMPLING_COLUMNS:
            arrays[name][:num] = columns[field]
        sampled_positions = np.array([item.sampled_position for item in work], dtype=np.int64)
        arrays["steps"][:num] = sampled_positions - np.array(columns["prompt_len"], dtype=np.int64)
    return _as_tensors(arrays)


def check_sampling_row(sampling: SamplingMeta) -> None:
    """Lay one request's sampler row out as a step would (its sampling columns and its
    logits-processing row): a value the fixed-width arrays cannot hold is a ValueError naming
    the field when the request is added, so it fails alone and never the step it would share.
    (``SamplingParams``' bounds keep such values out; this is the second line of defence.)"""
    for _, field, dtype in SAMPLING_COLUMNS:
        value = getattr(sampling, field)
        try:
            with np.errstate(over="ignore"):
                held = np.array([value], dtype=dtype)[0].item()
        except (OverflowError, TypeError, ValueError):
            held = None
        fits = held == value if np.issubdtype(dtype, np.integer) else held is not None and math.isfinite(held)
        if not fits:
            raise ValueError(f"{field} {value!r} does not fit the sampler's {np.dtype(dtype).name} inputs")
    if sampling.processing is not None:
        try:
            row_arrays(sampling.processing)
        except (OverflowError, TypeError, ValueError, IndexError) as err:
            raise ValueError(f"logits processing of this request does not fit the device's rows: {err}") from None
