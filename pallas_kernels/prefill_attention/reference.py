"""THE reference for prefill attention over paged context: the executable spec and CPU path.

Several prompts are packed into one row of tokens; segment ids keep them apart. Every key is
read from the pages (the new tokens' K/V are written before the call), so context that came
from the prefix cache needs no special case.

Shapes:
  q                [num_tokens, num_heads, head_dim]
  k_pages, v_pages [num_kv_heads, num_blocks, block_size, head_dim]
  context_slots    [num_keys] int   flat slot (block * block_size + offset) of each key
  key_positions    [num_keys] int   position of each key within its sequence
  key_segments     [num_keys] int   which packed sequence a key belongs to
  query_positions  [num_tokens] int
  query_segments   [num_tokens] int
The model runner lays keys out in whole pages (each run of block_size keys from a multiple of
block_size lies in one page at matching offsets; a context ending mid-page is padded to the
page's end with segment -1 keys): the Pallas kernel reads pages, not slots, and needs it; this
reference and the eager provider take any layout.
Returns [num_tokens, num_heads, head_dim] in q's dtype. Query i sees key j when their segments
match and key_positions[j] <= query_positions[i] (and > query_positions[i] - sliding_window).
Every query must see at least one key (padding: give padding queries and keys one shared
segment), otherwise its row is NaN. Scores are computed in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpu_executor.kernels.paged_attention.reference import soft_cap_scores


def gather_slots(pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, bs, d] gathered at flat slots [N] -> [kv_heads, N, d]."""
    kv_heads, _, _, head_dim = pages.shape
    return pages.reshape(kv_heads, -1, head_dim).index_select(1, slots)


def prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                      context_slots: torch.Tensor, key_positions: torch.Tensor,
                      key_segments: torch.Tensor, query_positions: torch.Tensor,
                      query_segments: torch.Tensor, *, scale: float,
                      soft_cap: Optional[float] = None,
                      sliding_window: Optional[int] = None) -> torch.Tensor:
    """Segment-causal attention of packed queries over keys read from the pages."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_pages.shape[0]
    group = num_heads // kv_heads
    k = gather_slots(k_pages, context_slots).float()  # [kv_heads, num_keys, d]
    v = gather_slots(v_pages, context_slots).float()
    # Query heads of one KV head folded into the rows: one matmul per KV head (GQA).
    qg = (q.float() * scale).reshape(num_tokens, kv_heads, group, head_dim).permute(1, 2, 0, 3)
    scores = torch.matmul(qg.reshape(kv_heads, group * num_tokens, head_dim), k.transpose(1, 2))
    scores = soft_cap_scores(scores.reshape(kv_heads, group, num_tokens, -1), soft_cap)
    allowed = (key_segments[None, :] == query_segments[:, None]) & \
        (key_positions[None, :] <= query_positions[:, None])
    if sliding_window is not None:
        allowed = allowed & (key_positions[None, :] > query_positions[:, None] - sliding_window)
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = torch.matmul(probs, v[:, None])  # [kv_heads, group, tokens, d]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim).to(q.dtype)
