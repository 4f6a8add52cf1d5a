"""Paged decode attention as a Pallas TPU kernel (one query token per sequence).

Contract: ``reference.paged_attention``. Grid: (sequence, kv head, chunk of pages). Each grid
step DMAs ``pages_per_chunk`` pages of K and V for its sequence and KV head from HBM into
VMEM (page ids come from the block table in SMEM), then folds them into an online softmax
(running max, running sum and fp32 accumulator in VMEM scratch) for the query heads of that
KV head (GQA: the group's heads are the rows of one matmul). Chunks before a sliding window
or past the context do no work and no DMA. The copy of chunk c+1 starts before chunk c is
computed (two VMEM slots), so only the first chunk of each (sequence, head) waits on HBM.

TPU constraints (checked in ``validate``):
- head_dim is the lane dim of every block and matmul: a multiple of 128.
- block_size is the sublane dim of a page in VMEM; a page DMA'd into a slot of the VMEM
  buffer must start on a tile boundary: a multiple of 8 (16 for bf16, two rows a sublane).
- VMEM: 2 slots x (K + V) x pages_per_chunk x block_size x head_dim, plus q, out and the
  fp32 accumulator, must fit the VMEM budget (``tpu_layout``).
- SMEM holds the block table (int32, flattened: a 2-D SMEM array pads its minor dim to
  128 words) and the context lengths. SMEM is 1 MiB up to v6e; tables larger than
  ``SMEM_TABLE_BUDGET_BYTES`` (half of it, the rest is Mosaic's) are cut into sub-batches,
  one kernel call each.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_executor.kernels.tpu_layout import (
    LANES,
    check_attention_operands,
    check_attention_shapes,
    check_vmem,
    itemsize,
    pin_mosaic_ir_version,
    sublanes,
)

SMEM_TABLE_BUDGET_BYTES = 512 * 1024
CHUNK_TOKENS = 512  # tokens per grid step: amortises the ~0.35 us per-step overhead


def default_pages_per_chunk(block_size: int, width: int) -> int:
    return max(1, min(width, CHUNK_TOKENS // block_size))


def validate(q_shape, pages_shape, dtype_name: str, pages_per_chunk: int) -> None:
    """Raise ValueError naming the first TPU constraint these shapes break."""
    check_attention_shapes("paged_attention", q_shape, pages_shape, dtype_name)
    _, heads, head_dim = q_shape
    kv_heads, _, block_size, _ = pages_shape
    if block_size % sublanes(dtype_name):
        raise ValueError(f"block_size={block_size} must be a multiple of {sublanes(dtype_name)} "
                         f"for {dtype_name} pages")
    size = itemsize(dtype_name)
    group = heads // kv_heads
    need = 4 * pages_per_chunk * block_size * head_dim * size + group * head_dim * (4 * size + 4)
    check_vmem("paged_attention", need, f"pages_per_chunk={pages_per_chunk}")


def _chunk_range(length, chunk_tokens: int, sliding_window: Optional[int]):
    """First and last chunk holding keys this query sees (last < first when length is 0)."""
    first = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0) // chunk_tokens
    return first, (length - 1) // chunk_tokens


def _kernel(lens_ref, tables_ref, q_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sems, m_ref,
            l_ref, acc_ref, *, scale, soft_cap, sliding_window, pages_per_chunk, width):
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size = k_buf.shape[2]
    chunk_tokens = pages_per_chunk * block_size
    length = lens_ref[b]
    first, last = _chunk_range(length, chunk_tokens, sliding_window)
    active = jnp.logical_and(c >= first, c <= last)

    def page_copies(chunk, slot):
        copies = []
        for p in range(pages_per_chunk):
            page = tables_ref[b * width + chunk * pages_per_chunk + p]
            for kind, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                copies.append(pltpu.make_async_copy(hbm.at[h, page], buf.at[slot, p], sems.at[kind, slot]))
        return copies

    @pl.when(jnp.logical_and(active, c == first))
    def _start():
        for copy in page_copies(c, c % 2):
            copy.start()
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(jnp.logical_and(active, c < last))
    def _prefetch_next():
        for copy in page_copies(c + 1, (c + 1) % 2):
            copy.start()

    @pl.when(active)
    def _attend():
        for copy in page_copies(c, c % 2):
            copy.wait()
        _online_softmax_step(q_ref, k_buf.at[c % 2], v_buf.at[c % 2], m_ref, l_ref, acc_ref,
                             c * chunk_tokens, length, scale, soft_cap, sliding_window)

    @pl.when(jnp.logical_and(active, c == last))
    def _finish():
        out_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(out_ref.dtype)

    @pl.when(jnp.logical_and(length <= 0, c == 0))
    def _empty():  # no context: define the output instead of leaving VMEM garbage
        out_ref[...] = jnp.zeros_like(out_ref)


def _online_softmax_step(q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, start, length, scale,
                         soft_cap, sliding_window):
    """Fold one chunk of keys into the running (max, sum, accumulator)."""
    tokens = k_ref.shape[0] * k_ref.shape[1]
    k = k_ref[...].reshape(tokens, -1).astype(jnp.float32)
    v = v_ref[...].reshape(tokens, -1).astype(jnp.float32)
    q = q_ref[...].astype(jnp.float32) * scale
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    pos = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    allowed = pos < length
    if sliding_window is not None:
        allowed = jnp.logical_and(allowed, pos > length - 1 - sliding_window)
    # Every active chunk holds at least one allowed key, so the new max is finite.
    s = jnp.where(allowed, s, -jnp.inf)
    m_prev = m_ref[:, :1]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_next = alpha * l_ref[:, :1] + p.sum(axis=1, keepdims=True)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l_next, l_ref.shape)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window",
                                             "pages_per_chunk", "interpret"))
def paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale: float,
                    soft_cap: Optional[float] = None, sliding_window: Optional[int] = None,
                    pages_per_chunk: Optional[int] = None, interpret: bool = False):
    """Decode attention over paged K/V; see ``reference.paged_attention``."""
    batch, width = block_tables.shape
    ppc = pages_per_chunk or default_pages_per_chunk(k_pages.shape[2], width)
    check_attention_operands("paged_attention", q, k_pages, v_pages)
    validate(q.shape, k_pages.shape, jnp.dtype(q.dtype).name, ppc)
    padded_width = -(-width // ppc) * ppc
    # Entries past a context are never attended but are still DMA'd: keep them in range.
    tables = jnp.clip(jnp.pad(block_tables, ((0, 0), (0, padded_width - width))), 0,
                      k_pages.shape[1] - 1).astype(jnp.int32)
    rows = max(1, SMEM_TABLE_BUDGET_BYTES // (padded_width * 4))
    call = functools.partial(_call, k_pages=k_pages, v_pages=v_pages, scale=scale,
                             soft_cap=soft_cap, sliding_window=sliding_window, ppc=ppc,
                             interpret=interpret)
    outs = [call(q[i:i + rows], context_lens[i:i + rows].astype(jnp.int32), tables[i:i + rows])
            for i in range(0, batch, rows)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


def _call(q, lens, tables, *, k_pages, v_pages, scale, soft_cap, sliding_window, ppc, interpret):
    batch, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_pages.shape
    group, width = heads // kv_heads, tables.shape[1]
    q4 = q.reshape(batch, kv_heads, group, head_dim)
    q_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, c, lens, tables: (b, h, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pltpu.ANY)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(batch, kv_heads, width // ppc),
        in_specs=[q_spec, any_spec, any_spec], out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2, ppc, block_size, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, ppc, block_size, head_dim), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((group, LANES), jnp.float32),
                        pltpu.VMEM((group, LANES), jnp.float32),
                        pltpu.VMEM((group, head_dim), jnp.float32)])
    kernel = functools.partial(_kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                               pages_per_chunk=ppc, width=width)
    pin_mosaic_ir_version()
    out = pl.pallas_call(
        kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
    )(lens, tables.reshape(-1), q4, k_pages, v_pages)
    return out.reshape(batch, heads, head_dim)
