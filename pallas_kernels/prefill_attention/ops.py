"""The ``prefill_attention`` op: its providers and the call models use."""
from __future__ import annotations

from pallas_kernels.prefill_attention import reference
from pallas_kernels.registry import REGISTRY, Provider

OP_NAME = "prefill_attention"


def register(registry=REGISTRY) -> None:
    """Register this op's providers (the reference accepts every call)."""
    registry.register(OP_NAME, Provider("reference", reference.prefill_attention, priority=0,
                                        is_reference=True))


def prefill_attention(q, k_pages, v_pages, context_slots, key_positions, key_segments,
                      query_positions, query_segments, *, scale, soft_cap=None, sliding_window=None):
    """Packed, segment-causal prefill attention over paged context; see the reference."""
    return REGISTRY.dispatch(OP_NAME, q, k_pages, v_pages, context_slots, key_positions,
                             key_segments, query_positions, query_segments, scale=scale,
                             soft_cap=soft_cap, sliding_window=sliding_window)
