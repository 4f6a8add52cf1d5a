"""The ``paged_attention`` op: its providers and the call models use."""
from __future__ import annotations

from pallas_kernels.paged_attention import reference
from pallas_kernels.registry import REGISTRY, Provider

OP_NAME = "paged_attention"


def register(registry=REGISTRY) -> None:
    """Register this op's providers (the reference accepts every call)."""
    registry.register(OP_NAME, Provider("reference", reference.paged_attention, priority=0,
                                        is_reference=True))


def paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
                    sliding_window=None):
    """Decode attention over paged K/V; see ``reference.paged_attention`` for the contract."""
    return REGISTRY.dispatch(OP_NAME, q, k_pages, v_pages, context_lens, block_tables,
                             scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
