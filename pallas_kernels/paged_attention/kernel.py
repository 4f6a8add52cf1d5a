"""Paged decode attention as a Pallas TPU kernel (one or several query tokens per sequence).

Contract: ``reference.paged_attention``. Grid: (sequence, kv head, chunk of pages). Each grid
step DMAs ``pages_per_chunk`` pages of K and V for its sequence and KV head from HBM into
VMEM (page ids come from the block table in SMEM), then folds them into an online softmax
(running max, running sum and fp32 accumulator in VMEM scratch) for the query rows of that
KV head: the group's heads (GQA) of each of the sequence's queries are the rows of one
matmul, so a verify of k drafts (k + 1 queries, each masked to its own causal prefix) reads
the pages once, as a decode does. Chunks before a sliding window or past the context do no
work and no DMA. The copy of chunk c+1 starts before chunk c is
computed (two VMEM slots), so only the first chunk of each (sequence, head) waits on HBM.

The cost estimate (``cost_estimate``) counts what this grid DMAs and computes when every
sequence's context fills its block table: the bucket's context width, what the compiled graph
is sized for and, without a window, the most it can read (the real lengths are traced values;
an estimate is a static number).

TPU constraints (checked in ``validate``):
- head_dim is the lane dim of every block and matmul: a multiple of 128.
- block_size is the sublane dim of a page in VMEM; a page DMA'd into a slot of the VMEM
  buffer must start on a tile boundary: a multiple of 8 (16 for bf16, two rows a sublane).
- VMEM: 2 slots x (K + V) x pages_per_chunk x block_size x head_dim, plus q, out and the
  fp32 accumulator (queries x group rows), must fit the VMEM budget (``tpu_layout``).
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
    sublanes,
)

SMEM_TABLE_BUDGET_BYTES = 512 * 1024
CHUNK_TOKENS = 512  # tokens per grid step: amortises the ~0.35 us per-step overhead


def default_pages_per_chunk(block_size: int, width: int) -> int:
    return max(1, min(width, CHUNK_TOKENS // block_size))


def validate(q_shape, pages_shape, dtype_name: str, pages_per_chunk: int, queries: int = 1) -> None:
    """Raise ValueError naming the first TPU constraint these shapes break (``queries``: query
    rows per sequence)."""
    check_attention_shapes("paged_attention", q_shape, pages_shape, dtype_name)
    _, heads, head_dim = q_shape
    kv_heads, _, block_size, _ = pages_shape
    if block_size % sublanes(dtype_name):
        raise ValueError(f"block_size={block_size} must be a multiple of {sublanes(dtype_name)} "
                         f"for {dtype_name} pages")
    size = itemsize(dtype_name)
    group = queries * heads // kv_heads
    need = 4 * pages_per_chunk * block_size * head_dim * size + group * head_dim * (4 * size + 4)
    check_vmem("paged_attention", need, f"pages_per_chunk={pages_per_chunk}")


def _chunk_range(length, chunk_tokens: int, sliding_window: Optional[int], queries: int, maximum=jnp.maximum):
    """First and last chunk holding keys the sequence's query rows see (last < first when
    length is 0); the first query row, the shortest, starts the window. ``maximum=max`` takes
    Python ints (the cost estimate's static count)."""
    shortest = maximum(length - queries + 1, 1)
    first = 0 if sliding_window is None else maximum(shortest - sliding_window, 0) // chunk_tokens
    return first, (length - 1) // chunk_tokens


def _row_lengths(length, num_rows: int, group: int, queries: int):
    """[num_rows, 1]: the keys each query row sees (row r is query r // group of the sequence's
    last ``queries`` positions, clamped to see key 0)."""
    query = jax.lax.broadcasted_iota(jnp.int32, (num_rows, 1), 0) // group
    return jnp.maximum(length - (queries - 1) + query, 1)


def _kernel(lens_ref, tables_ref, q_ref, k_hbm, v_hbm, out_ref, k_buf, v_buf, sems, m_ref,
            l_ref, acc_ref, *, scale, soft_cap, sliding_window, pages_per_chunk, width, queries):
    b, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_size = k_buf.shape[2]
    chunk_tokens = pages_per_chunk * block_size
    length = lens_ref[b]
    first, last = _chunk_range(length, chunk_tokens, sliding_window, queries)
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
        lengths = _row_lengths(length, q_ref.shape[0], q_ref.shape[0] // queries, queries)
        _online_softmax_step(q_ref, k_buf.at[c % 2], v_buf.at[c % 2], m_ref, l_ref, acc_ref,
                             c * chunk_tokens, lengths, scale, soft_cap, sliding_window)

    @pl.when(jnp.logical_and(active, c == last))
    def _finish():
        out_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(out_ref.dtype)

    @pl.when(jnp.logical_and(length <= 0, c == 0))
    def _empty():  # no context: define the output instead of leaving VMEM garbage
        out_ref[...] = jnp.zeros_like(out_ref)


def _online_softmax_step(q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, start, lengths, scale,
                         soft_cap, sliding_window):
    """Fold one chunk of keys into the running (max, sum, accumulator) of each query row
    (``lengths``: the keys each row sees)."""
    tokens = k_ref.shape[0] * k_ref.shape[1]
    k = k_ref[...].reshape(tokens, -1).astype(jnp.float32)
    v = v_ref[...].reshape(tokens, -1).astype(jnp.float32)
    q = q_ref[...].astype(jnp.float32) * scale
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    pos = start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
    allowed = pos < lengths
    if sliding_window is not None:
        allowed = jnp.logical_and(allowed, pos > lengths - 1 - sliding_window)
    s = jnp.where(allowed, s, -jnp.inf)
    m_prev = m_ref[:, :1]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    # A row may see no key yet (a later query's window starts past this chunk): its max stays
    # -inf, and exp(-inf - -inf) would be NaN; such a row adds nothing.
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
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
    if batch == 0 or q.shape[0] % batch:
        raise ValueError(f"paged_attention: {q.shape[0]} query rows do not divide evenly over {batch} sequences")
    queries = q.shape[0] // batch
    ppc = pages_per_chunk or default_pages_per_chunk(k_pages.shape[2], width)
    check_attention_operands("paged_attention", q, k_pages, v_pages)
    validate(q.shape, k_pages.shape, jnp.dtype(q.dtype).name, ppc, queries)
    padded_width = -(-width // ppc) * ppc
    # Entries past a context are never attended but are still DMA'd: keep them in range.
    tables = jnp.clip(jnp.pad(block_tables, ((0, 0), (0, padded_width - width))), 0,
                      k_pages.shape[1] - 1).astype(jnp.int32)
    rows = max(1, SMEM_TABLE_BUDGET_BYTES // (padded_width * 4))
    call = functools.partial(_call, k_pages=k_pages, v_pages=v_pages, scale=scale,
                             soft_cap=soft_cap, sliding_window=sliding_window, ppc=ppc,
                             queries=queries, context=width * k_pages.shape[2], interpret=interpret)
    outs = [call(q[i * queries:(i + rows) * queries], context_lens[i:i + rows].astype(jnp.int32), tables[i:i + rows])
            for i in range(0, batch, rows)]
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)


def _call(q, lens, tables, *, k_pages, v_pages, scale, soft_cap, sliding_window, ppc, queries, context, interpret):
    _, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_pages.shape
    batch, width = tables.shape
    rows = queries * heads // kv_heads  # a KV head's query rows: its group's heads of each query
    q4 = q.reshape(batch, queries, kv_heads, heads // kv_heads, head_dim).transpose(0, 2, 1, 3, 4)
    q4 = q4.reshape(batch, kv_heads, rows, head_dim)
    q_spec = pl.BlockSpec((None, None, rows, head_dim), lambda b, h, c, lens, tables: (b, h, 0, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(batch, kv_heads, width // ppc),
        in_specs=[q_spec, any_spec, any_spec], out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((2, ppc, block_size, head_dim), k_pages.dtype),
                        pltpu.VMEM((2, ppc, block_size, head_dim), v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32)])
    kernel = functools.partial(_kernel, scale=scale, soft_cap=soft_cap, sliding_window=sliding_window,
                               pages_per_chunk=ppc, width=width, queries=queries)
    out = pl.pallas_call(
        kernel, grid_spec=spec, out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(q.shape, k_pages.shape, width, ppc, queries, q.dtype.itemsize,
                                    k_pages.dtype.itemsize, soft_cap, sliding_window, context),
        interpret=interpret,
    )(lens, tables.reshape(-1), q4, k_pages, v_pages)
    out = out.reshape(batch, kv_heads, queries, heads // kv_heads, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch * queries, heads, head_dim)


def cost_estimate(q_shape, pages_shape, width: int, ppc: int, queries: int, itemsize: int, kv_itemsize: int,
                  soft_cap: Optional[float], sliding_window: Optional[int], context: Optional[int] = None
                  ) -> pl.CostEstimate:
    """What one call's grid DMAs and computes when every sequence has ``context`` keys (default:
    its table's ``width`` pages, the bucket's width; the real lengths are traced). ``width`` is
    the table's width padded to whole chunks, as the grid is. Per (sequence, KV head): the
    chunks ``_chunk_range`` keeps (at full context every chunk; with a window, those it reaches), each
    ``ppc`` whole pages of K and of V; q and the output once; the lengths and the table once
    into SMEM. Flops: both matmuls over each fetched chunk's keys, masked keys included;
    transcendentals: an exp per score (and a tanh with a soft cap), an exp per row per chunk.
    Without a window no row fetches more; with one, a shorter row may straddle one chunk more."""
    rows, heads, head_dim = q_shape
    kv_heads, _, block_size, _ = pages_shape
    batch, chunk_tokens = rows // queries, ppc * block_size
    full = width * block_size if context is None else context
    first, last = _chunk_range(full, chunk_tokens, sliding_window, queries, maximum=max)
    chunks = max(last - first + 1, 0)
    keys = chunks * chunk_tokens  # per (sequence, KV head), and per query row
    kv_bytes = 2 * batch * kv_heads * keys * head_dim * kv_itemsize
    accessed = kv_bytes + 2 * rows * heads * head_dim * itemsize + batch * (width + 1) * 4
    scores = rows * heads * keys
    return pl.CostEstimate(flops=4 * scores * head_dim,
                           transcendentals=scores * (2 if soft_cap is not None else 1) + rows * heads * chunks,
                           bytes_accessed=accessed)
