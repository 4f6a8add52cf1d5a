"""``write_kv_cache`` for the native CPU path, fp32: a small C kernel (``cpu_write.c``).

torch's scatter is about nine small ops per layer (the flat index, head-major copies of k and
v, two ``index_copy_``); the kernel copies each token's heads straight from k and v (views of
the QKV projection's output) into their slots, after checking every slot.
"""
from __future__ import annotations

import ctypes
import os

import torch

from tpu_executor.kernels import cpu_library

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_write.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64) * 2 + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 4

KERNEL = cpu_library.CFunction(SOURCE, "write_kv_cache_f32", _ARGTYPES, ctypes.c_int64)
supported = KERNEL.supported


def _fits_cache(new: torch.Tensor, cache: torch.Tensor) -> bool:
    return cpu_library.heads_contiguous(new) and new.shape[1:] == (cache.shape[0], cache.shape[3])


def supports_args(k=None, v=None, k_cache=None, v_cache=None, slot_mapping=None, *args, **kwargs) -> bool:
    """fp32 CPU tensors, untraced: contiguous caches of one shape, k and v ``[T, kv_heads, d]``
    with each token's heads contiguous, int64 slots ``[T]``."""
    if not cpu_library.untraced_fp32_cpu(k, v, k_cache, v_cache):
        return False
    caches = k_cache.dim() == 4 and v_cache.shape == k_cache.shape and k_cache.is_contiguous() \
        and v_cache.is_contiguous()
    if not (caches and _fits_cache(k, k_cache) and _fits_cache(v, v_cache)):
        return False
    return isinstance(slot_mapping, torch.Tensor) and slot_mapping.dtype == torch.int64 \
        and slot_mapping.device.type == "cpu" and slot_mapping.shape == k.shape[:1] and v.shape[0] == k.shape[0]


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.write_kv_cache`` (fp32 CPU tensors); a slot outside the
    caches raises a ValueError naming it, before anything is written."""
    kv_heads, num_blocks, block_size, d = k_cache.shape
    slots = slot_mapping.contiguous()
    bad = KERNEL(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                 slots.data_ptr(), k.shape[0], kv_heads, num_blocks * block_size, d)
    if bad >= 0:
        raise ValueError(f"token {bad}'s KV-cache slot {int(slots[bad])} is outside the cache's "
                         f"{num_blocks * block_size} slots ({num_blocks} blocks of {block_size})")
