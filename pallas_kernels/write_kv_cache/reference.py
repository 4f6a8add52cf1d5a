"""THE reference for ``write_kv_cache``: this step's keys and values into the paged caches.

  k, v              [T, kv_heads, d]: the step's tokens' keys and values
  k_cache, v_cache  [kv_heads, num_blocks, block_size, d]: one layer's pages, updated in place
  slot_mapping      [T]: each token's slot (block * block_size + offset); padding tokens
                    point into the null block
Returns nothing. The caches are written through ``index_copy_`` on a flattened view and, on
XLA, marked as donated buffers: without donation a compiled step would copy the whole cache.
"""
from __future__ import annotations

import torch


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter k, v into the caches at ``slot_mapping``."""
    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    if k_cache.device.type == "xla":
        torch.ops.xla.dynamo_set_buffer_donor_(k_cache, True)
        torch.ops.xla.dynamo_set_buffer_donor_(v_cache, True)
    head_offsets = torch.arange(kv_heads, device=k.device)[:, None] * (num_blocks * block_size)
    index = (head_offsets + slot_mapping[None, :]).reshape(-1)
    for cache, new in ((k_cache, k), (v_cache, v)):
        rows = new.transpose(0, 1).reshape(-1, head_dim)
        if cache.device.type == "jax":
            # torchax's view() is a copy, so an in-place write through it would be lost: the
            # whole tensor is replaced instead (in place all the same: the JAX path donates it).
            cache.copy_(cache.reshape(-1, head_dim).index_copy(0, index, rows).reshape(cache.shape))
        else:
            cache.view(-1, head_dim).index_copy_(0, index, rows)
