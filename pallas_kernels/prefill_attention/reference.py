"""THE reference for prefill attention over paged context: the executable spec and CPU path.

One sequence's padded prompt attends causally to its context, all of it read from the pages
(the new tokens' K/V are written before the call, so a prefix-cached part needs no special
case).

Shapes:
  q            [num_tokens, num_heads, head_dim]   query tokens (real ones first, then padding)
  k_pages      [num_kv_heads, num_blocks, block_size, head_dim]
  v_pages      [num_kv_heads, num_blocks, block_size, head_dim]
  block_table  [context_blocks] int   pages of the context, in order (padding -> any page)
  positions    [num_tokens] int       absolute position of each query token
Returns [num_tokens, num_heads, head_dim] in q's dtype. Query i sees keys at positions
<= positions[i] (and > positions[i] - sliding_window). Scores are computed in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from pallas_kernels.paged_attention.reference import attention_scores_mask, gather_pages


def prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      block_table: torch.Tensor, positions: torch.Tensor, *, scale: float,
                      soft_cap: Optional[float] = None,
                      sliding_window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of ``q`` over the context held in ``block_table``'s pages."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = num_heads // kv_heads
    k = gather_pages(k_pages, block_table).float()  # [kv_heads, L, d]
    v = gather_pages(v_pages, block_table).float()
    qg = q.float().reshape(num_tokens, kv_heads, group, head_dim) * scale
    scores = torch.einsum("thgd,hld->hgtl", qg, k)
    key_pos = torch.arange(k.shape[1], device=q.device).view(1, 1, 1, -1)
    query_pos = positions.view(1, 1, -1, 1)
    scores = attention_scores_mask(scores, key_pos, query_pos, soft_cap, sliding_window)
    out = torch.einsum("hgtl,hld->thgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)
