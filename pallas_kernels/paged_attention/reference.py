"""THE reference for paged decode attention: the executable spec and the CPU path.

Shapes:
  q             [batch, num_heads, head_dim]             one query token per sequence
  k_pages       [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages       [num_kv_heads, num_blocks, block_size, head_dim]
  context_lens  [batch] int   tokens of context (including the current one)
  block_tables  [batch, max_blocks] int   page ids; entries past the context are ignored
Returns [batch, num_heads, head_dim] in q's dtype. Scores are computed in fp32.
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


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    context_lens: torch.Tensor, block_tables: torch.Tensor, *, scale: float,
                    soft_cap: Optional[float] = None,
                    sliding_window: Optional[int] = None) -> torch.Tensor:
    """Attention of each sequence's one query over its paged context (GQA-aware)."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = num_heads // kv_heads
    k = gather_pages(k_pages, block_tables).float()  # [batch, kv_heads, L, d]
    v = gather_pages(v_pages, block_tables).float()
    qg = q.float().reshape(batch, kv_heads, group, head_dim) * scale
    # Written as (K @ q^T)^T: XLA's CPU backend runs this batched dot 2x faster than q @ K^T
    # (it is slow when both operands contract their minor dimension). Same values.
    scores = soft_cap_scores(torch.matmul(k, qg.transpose(2, 3)).transpose(2, 3), soft_cap)
    key_pos = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    query_pos = (context_lens - 1).view(batch, 1, 1, 1)
    allowed = key_pos <= query_pos
    if sliding_window is not None:
        allowed = allowed & (key_pos > query_pos - sliding_window)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.matmul(probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
