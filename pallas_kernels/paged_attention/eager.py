"""Paged decode attention for eager (untraced) calls on CPU or GPU: only the pages in use.

The reference reads every row's pages up to the block table's width, which the engine pads
to a decode context bucket (on `bench throughput`'s workload 42% of the slots read are
padding), and attends with a matmul, a mask and a softmax. Here the table is cut to the
pages the longest context needs, and without a soft-cap torch's fused scaled-dot-product
attention does the rest (measured on a 2-core AVX2 CPU, 32 rows of 80-300 tokens: 5.7 ms -> 3.0 ms per layer).
On a CPU this op is bound by memory traffic (gathering the pages, then reading them again),
so when the rows' contexts differ enough the rows are split in two groups by length, each
group reading up to its own longest context only.
Cutting the table reads lengths on the host: the native path only, never a traced graph.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from tpu_executor.kernels.paged_attention import reference

# Split the rows in two groups only when that reads at most this share of the pages one group
# would: a second group costs a few small ops (argsort, row gathers) per layer.
SPLIT_WHEN_PAGES_AT_MOST = 0.9


def pages_in_use(context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """``block_tables`` cut to the columns the longest context reaches (at least one)."""
    longest = int(context_lens.max()) if context_lens.numel() else 1
    return block_tables[:, :max(1, -(-longest // block_size))]


def length_groups(context_lens: torch.Tensor, block_size: int) -> Optional[List[torch.Tensor]]:
    """Row indices of two groups (shorter contexts, longer ones) when splitting the batch
    there reads at most ``SPLIT_WHEN_PAGES_AT_MOST`` of the pages one group reads; else None."""
    order = torch.argsort(context_lens)
    pages = [-(-n // block_size) for n in context_lens[order].tolist()]
    if len(pages) < 2:
        return None
    rows, longest = len(pages), pages[-1]
    # Splitting before row i: the first i rows read pages[i - 1] each, the rest `longest`.
    cost, split = min((i * pages[i - 1] + (rows - i) * longest, i) for i in range(1, rows))
    if cost > SPLIT_WHEN_PAGES_AT_MOST * rows * longest:
        return None
    return [order[:split], order[split:]]


def paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
                    sliding_window=None):
    """Same contract as ``reference.paged_attention``."""
    args = dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
    queries = reference.queries_per_sequence(q, block_tables)
    by_sequence = q.reshape(block_tables.shape[0], queries, *q.shape[1:])
    groups = length_groups(context_lens, k_pages.shape[2])
    if groups is None:
        return one_group(by_sequence, k_pages, v_pages, context_lens, block_tables, **args).reshape(q.shape)
    out = torch.empty_like(by_sequence)
    for rows in groups:
        out[rows] = one_group(by_sequence[rows], k_pages, v_pages, context_lens[rows], block_tables[rows], **args)
    return out.reshape(q.shape)


def one_group(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
              sliding_window=None):
    """Attention of sequences' query rows ``q [batch, queries, heads, d]`` over their pages,
    the table cut to their longest context."""
    tables = pages_in_use(context_lens, block_tables, k_pages.shape[2])
    if soft_cap is not None:  # SDPA exposes no scores to cap
        out = reference.paged_attention(q.flatten(0, 1), k_pages, v_pages, context_lens, tables, scale=scale,
                                        soft_cap=soft_cap, sliding_window=sliding_window)
        return out.reshape(q.shape)
    k = reference.gather_pages(k_pages, tables).float()  # [batch, kv_heads, keys, d]
    v = reference.gather_pages(v_pages, tables).float()
    key_pos = torch.arange(k.shape[2], device=q.device)[None, None, :]
    query_pos = reference.query_positions(context_lens, q.shape[1])[:, :, None]
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed = allowed & (key_pos > query_pos - sliding_window)
    out = F.scaled_dot_product_attention(q.float().transpose(1, 2), k, v, attn_mask=allowed[:, None],
                                         scale=scale, enable_gqa=True)  # [batch, heads, queries, d]
    return out.transpose(1, 2).to(q.dtype)
