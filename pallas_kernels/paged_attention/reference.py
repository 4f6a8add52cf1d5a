"""THE reference for paged decode attention: the executable spec and the CPU path.

Shapes:
  q             [batch * queries, num_heads, head_dim]   ``queries`` rows per sequence, in order
  k_pages       [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages       [num_kv_heads, num_blocks, block_size, head_dim]
  context_lens  [batch] int   tokens of context (including the last query's own)
  block_tables  [batch, max_blocks] int   page ids; entries past the context are ignored
Returns q's shape and dtype. Scores are computed in fp32.

``queries`` is ``q.shape[0] // batch``: 1 for a decode (one token per sequence), k + 1 for a
verify of k draft tokens (speculative decoding), which reads each sequence's pages once for
all of its positions. A sequence's query rows are its last ``queries`` positions: row ``j``
sits at ``context_len - queries + j`` and sees the keys up to it (causal). A sequence with
fewer real queries pads at the front: those rows' positions are clamped to 0 (they see key 0;
their outputs are discarded), and a sequence with no context sees nothing.
"""
from __future__ import annotations

from typing import Optional

import torch


def soft_cap_scores(scores: torch.Tensor, soft_cap: Optional[float]) -> torch.Tensor:
    """Gemma-2's logit soft-capping: cap * tanh(scores / cap)."""
    if soft_cap is None:
        return scores
    return torch.tanh(scores / soft_cap) * soft_cap


def gather_pages(pages: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, bs, d] and [batch, max_blocks] -> [batch, kv_heads, max_blocks*bs, d]."""
    kv_heads, num_blocks, block_size, head_dim = pages.shape
    batch, width = block_tables.shape
    # One contiguous row per (head, page): XLA's CPU gather is ~2x faster on this form than
    # on advanced indexing of the page dimension.
    rows = pages.reshape(kv_heads * num_blocks, block_size * head_dim)
    heads = torch.arange(kv_heads, device=pages.device)
    index = (block_tables[:, None, :] + heads[None, :, None] * num_blocks).reshape(-1)
    return rows.index_select(0, index).reshape(batch, kv_heads, width * block_size, head_dim)


def queries_per_sequence(q: torch.Tensor, block_tables: torch.Tensor) -> int:
    """How many query rows of ``q`` each block-table row owns (1: a decode)."""
    rows, batch = q.shape[0], block_tables.shape[0]
    if batch == 0 or rows % batch:
        raise ValueError(f"paged_attention: {rows} query rows do not divide evenly over {batch} sequences")
    return rows // batch


def query_positions(context_lens: torch.Tensor, queries: int) -> torch.Tensor:
    """[batch, queries]: the position of each query row (its sequence's last ``queries``
    positions, clamped to 0; -1 in a sequence with no context, which sees nothing)."""
    offsets = torch.arange(queries - 1, -1, -1, device=context_lens.device)
    floor = context_lens.clamp(max=1) - 1  # 0, or -1 without context
    return torch.maximum(context_lens[:, None] - 1 - offsets[None, :], floor[:, None])


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, *, scale: float,
                    soft_cap: Optional[float] = None,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
    """Attention of each sequence's query rows over its paged context (GQA-aware)."""
    _, num_heads, head_dim = q.shape
    batch, queries = block_tables.shape[0], queries_per_sequence(q, block_tables)
    kv_heads = k_pages.shape[0]
    group = num_heads // kv_heads
    k = gather_pages(k_pages, block_tables).float()  # [batch, kv_heads, L, d]
    v = gather_pages(v_pages, block_tables).float()
    # A KV head's rows: each query's heads of its group, the queries in order.
    qg = (q.float() * scale).reshape(batch, queries, kv_heads, group, head_dim).transpose(1, 2)
    qg = qg.reshape(batch, kv_heads, queries * group, head_dim)
    # Written as (K @ q^T)^T: XLA's CPU backend runs this batched dot 2x faster than q @ K^T
    # (it is slow when both operands contract their minor dimension). Same values.
    scores = soft_cap_scores(torch.matmul(k, qg.transpose(2, 3)).transpose(2, 3), soft_cap)
    key_pos = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    query_pos = query_positions(context_lens, queries).repeat_interleave(group, dim=1)
    query_pos = query_pos.view(batch, 1, queries * group, 1)
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed = allowed & (key_pos > query_pos - sliding_window)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.matmul(probs, v).reshape(batch, kv_heads, queries, group, head_dim).transpose(1, 2)
    return out.reshape(batch * queries, num_heads, head_dim).to(q.dtype)
