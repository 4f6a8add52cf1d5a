"""Paged attention layer: writes this step's K/V into the cache, then attends through the ops.

The KV cache of one layer is a pair of tensors ``[num_kv_heads, num_blocks, block_size,
head_dim]`` (the page layout the Pallas kernels take), updated in place by the
``write_kv_cache`` op (donated buffers on XLA: without donation the compiled step would copy
the whole cache every call).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from tpu_executor.kernels.paged_attention.ops import paged_attention
from tpu_executor.kernels.prefill_attention.ops import prefill_attention
from tpu_executor.kernels.write_kv_cache.ops import write_kv_cache


@dataclass
class PrefillMetadata:
    """Packed prefill: keys are read from the pages at ``context_slots`` (all ``[K]``)."""

    context_slots: torch.Tensor
    key_positions: torch.Tensor
    key_segments: torch.Tensor
    query_segments: torch.Tensor


@dataclass
class DecodeMetadata:
    """Decode batch: ``block_tables [B, max_blocks]``, ``context_lens [B]``."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class HiddenTaps:
    """Where a model call copies the residual stream entering some of its layers (an EAGLE-3
    head reads three of them): layer ``layer_ids[j]``'s input goes to ``buffers[j]``, token
    ``t`` to row ``rows[t]`` (padding tokens share a discard row)."""

    layer_ids: Tuple[int, ...]
    buffers: List[torch.Tensor]
    rows: torch.Tensor

    def record(self, layer_index: int, hidden: torch.Tensor) -> None:
        """Copy ``hidden`` (the input of layer ``layer_index``) if that layer is tapped."""
        for buffer, layer_id in zip(self.buffers, self.layer_ids):  # a layer may be named twice
            if layer_id == layer_index:
                write_rows(buffer, self.rows, hidden)


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """``buffer[rows] = values`` in place (a buffer the call updates: donated on the JAX path)."""
    if buffer.device.type == "jax":  # torchax: an in-place write replaces the whole tensor
        buffer.copy_(buffer.index_copy(0, rows, values.to(buffer.dtype)))
    else:
        buffer.index_copy_(0, rows, values.to(buffer.dtype))


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, all device tensors of fixed (bucketed) shape.

    ``positions [T]`` and ``slot_mapping [T]`` (where each token's K/V goes; padding -> the
    null block) are common; ``prefill``, ``decode`` or, in a mixed call (eager devices only),
    both are set: the prefill's tokens first (as many as its ``query_segments``), then one
    token per decode row. ``rope`` holds, on an untraced call, the cos and sin each RoPE
    computed for ``positions``, for the layers after the first; ``taps``, when set, copies
    some layers' inputs out (``HiddenTaps``); ``lora_slots [T]``, when set, is each token's
    adapter slot (multi-LoRA: 0 is the base model).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    prefill: Optional[PrefillMetadata] = None
    decode: Optional[DecodeMetadata] = None
    rope: Dict = field(default_factory=dict)
    taps: Optional[HiddenTaps] = None
    lora_slots: Optional[torch.Tensor] = None


def paged_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
                            meta: AttentionMetadata, *, scale: float,
                            soft_cap: Optional[float] = None,
                            sliding_window: Optional[int] = None) -> torch.Tensor:
    """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> attention output ``[T, heads, d]``."""
    k_cache, v_cache = kv_cache
    if k_cache.shape[0] != k.shape[1]:  # the cache repeats each KV head (``Worker.cache_kv_heads``)
        repeats = k_cache.shape[0] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    options = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    p, d = meta.prefill, meta.decode
    if p is None:
        return paged_attention(q, k_cache, v_cache, d.context_lens, d.block_tables, **options)
    if d is None:
        return prefill_attention(q, k_cache, v_cache, p.context_slots, p.key_positions, p.key_segments,
                                 meta.positions, p.query_segments, **options)
    num_prefill = p.query_segments.shape[0]  # a mixed call: the pack's tokens, then the decode rows'
    prefilled = prefill_attention(q[:num_prefill], k_cache, v_cache, p.context_slots, p.key_positions,
                                  p.key_segments, meta.positions[:num_prefill], p.query_segments, **options)
    decoded = paged_attention(q[num_prefill:], k_cache, v_cache, d.context_lens, d.block_tables, **options)
    return torch.cat([prefilled, decoded])
