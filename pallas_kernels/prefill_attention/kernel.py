"""Packed prefill attention as a Pallas TPU kernel (flash attention with segment ids).

Contract: ``reference.prefill_attention``, with the model runner's key layout: keys come in
whole pages (each run of ``block_size`` keys starting at a multiple of ``block_size`` lies in
one page at matching offsets; a context that ends mid-page is padded to the page's end with
masked keys). The kernel reads the context's K/V straight from the pages: grid (kv head, query
block, key block); each key block is ``block_k / block_size`` pages whose ids come from SMEM
(scalar prefetch), DMA'd from HBM into VMEM, the next key block's pages started while the
current one is computed (two slots). VMEM use does not grow with the context, and no copy of
the context is made; prefix-cached context and earlier chunks of a prompt need no special case.
The query heads of one KV head are folded into the rows of each matmul (GQA shares every K/V
tile across its group); an online softmax keeps (max, sum, fp32 accumulator) in VMEM scratch.

Masking is by segment and position, per element. Whole key blocks are skipped (no DMA, no
compute) when no query of the block can see them: a per-(query block, key block) flag computed
on device from the blocks' segment and position bounds and prefetched into SMEM. That covers
keys of other packed prompts, keys in a prompt's future (causal), and keys behind a window.
The cost estimate (``cost_estimate``) counts the tiles the grid visits for one prompt that fills
the call (its queries the last positions of all its keys): the flags are traced values, and an
estimate is a static number.

TPU constraints (checked in ``validate``):
- head_dim is the lane dim of q/k/v blocks: a multiple of 128.
- block_q rows (second-minor dim of q blocks) are a multiple of 8 (16 for bf16); block_k is
  the lane dim of the score tile and of the key position/segment blocks: a multiple of 128,
  and a whole number of pages.
- A page DMA'd into a VMEM slot starts on a tile boundary: block_size a multiple of 8 (16 bf16).
- Query positions/segments are passed lane-broadcast [tokens, 128] and key ones
  sublane-broadcast [8, keys] so each block is a legal (8, 128)-tiled 2-D block.
- VMEM: double-buffered q and out blocks, two slots of K and V pages, the fp32 accumulator
  and the (max, sum) rows must fit the VMEM budget (``tpu_layout``).
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_executor.kernels.tpu_layout import (
    LANES,
    SUBLANES,
    check_attention_operands,
    check_attention_shapes,
    check_vmem,
    itemsize,
    sublanes,
)

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked block adds nothing


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def choose_blocks(num_tokens: int, num_keys: int, dtype_name: str):
    """Default (block_q, block_k): up to 128 query rows and 256 keys per grid step."""
    return min(128, _round_up(num_tokens, sublanes(dtype_name))), min(256, _round_up(num_keys, LANES))


def validate(q_shape, pages_shape, dtype_name: str, block_q: int, block_k: int) -> None:
    """Raise ValueError naming the first TPU constraint these shapes break."""
    check_attention_shapes("prefill_attention", q_shape, pages_shape, dtype_name)
    _, heads, head_dim = q_shape
    block_size = pages_shape[2]
    rows = sublanes(dtype_name)
    if block_q % rows or block_k % LANES:
        raise ValueError(f"block_q={block_q} must be a multiple of {rows} and block_k={block_k} "
                         f"a multiple of {LANES}")
    if block_size % rows or block_k % block_size:
        raise ValueError(f"block_size={block_size} must be a multiple of {rows} for {dtype_name} pages "
                         f"and divide block_k={block_k}")
    group_rows = heads // pages_shape[0] * block_q
    need = (2 * (2 * group_rows + 2 * block_k) * head_dim * itemsize(dtype_name)
            + group_rows * (head_dim + 2 * LANES) * 4)
    check_vmem("prefill_attention", need, f"blocks ({block_q}, {block_k})")


def blocks_needed(q_pos, q_seg, k_pos, k_seg, block_q, block_k, sliding_window):
    """[q_blocks * k_blocks] int32: 1 where some query of the block may see some key (jax or
    numpy arrays in, the same kind out)."""
    def bounds(x, block):
        x = x.reshape(-1, block)
        return x.min(axis=1)[:, None], x.max(axis=1)[:, None]

    (qs_lo, qs_hi), (qp_lo, qp_hi) = bounds(q_seg, block_q), bounds(q_pos, block_q)
    (ks_lo, ks_hi), (kp_lo, kp_hi) = bounds(k_seg, block_k), bounds(k_pos, block_k)
    ks_lo, ks_hi, kp_lo, kp_hi = ks_lo.T, ks_hi.T, kp_lo.T, kp_hi.T
    overlap = (ks_lo <= qs_hi) & (ks_hi >= qs_lo)
    # Position bounds only prove anything when both blocks hold one and the same prompt.
    one_prompt = (qs_lo == qs_hi) & (ks_lo == ks_hi) & (qs_lo == ks_lo)
    hidden = one_prompt & (kp_lo > qp_hi)
    if sliding_window is not None:
        hidden = hidden | (one_prompt & (kp_hi <= qp_lo - sliding_window))
    return (overlap & ~hidden).astype(jnp.int32).reshape(-1)


def _kernel(needed_ref, pages_ref, q_ref, k_hbm, v_hbm, qpos_ref, qseg_ref, kpos_ref, kseg_ref, out_ref,
            k_buf, v_buf, sems, m_ref, l_ref, acc_ref, *, scale, soft_cap, sliding_window):
    h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_k = pl.num_programs(2)
    pages_per_block = k_buf.shape[1]

    def needed(block):
        return needed_ref[i * num_k + block] == 1

    def page_copies(block, slot):
        copies = []
        for p in range(pages_per_block):
            page = pages_ref[block * pages_per_block + p]
            for kind, (hbm, buf) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                copies.append(pltpu.make_async_copy(hbm.at[h, page], buf.at[slot, p], sems.at[kind, slot]))
        return copies

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    # Key block j's pages were started by step j - 1 (which always runs); block 0 starts its own.
    @pl.when(jnp.logical_and(j == 0, needed(0)))
    def _start_first():
        for copy in page_copies(0, 0):
            copy.start()

    @pl.when(jnp.logical_and(j + 1 < num_k, needed(jnp.minimum(j + 1, num_k - 1))))
    def _prefetch_next():
        for copy in page_copies(j + 1, (j + 1) % 2):
            copy.start()

    @pl.when(needed(j))
    def _attend():
        for copy in page_copies(j, j % 2):
            copy.wait()
        _online_softmax_step(q_ref, k_buf.at[j % 2], v_buf.at[j % 2], qpos_ref, qseg_ref, kpos_ref, kseg_ref,
                             m_ref, l_ref, acc_ref, scale, soft_cap, sliding_window)

    @pl.when(j == num_k - 1)
    def _finish():
        out = acc_ref[...] / l_ref[:, :1]
        out_ref[...] = out.reshape(out_ref.shape).astype(out_ref.dtype)


def _online_softmax_step(q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, m_ref, l_ref, acc_ref,
                         scale, soft_cap, sliding_window):
    """Fold one key block (its pages in VMEM) into the running (max, sum, accumulator)."""
    group, block_q, head_dim = q_ref.shape
    keys = k_ref.shape[0] * k_ref.shape[1]
    q = q_ref[...].reshape(group * block_q, head_dim).astype(jnp.float32) * scale
    k = k_ref[...].reshape(keys, head_dim).astype(jnp.float32)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    q_pos, k_pos = qpos_ref[:, :1], kpos_ref[:1, :]
    allowed = (qseg_ref[:, :1] == kseg_ref[:1, :]) & (k_pos <= q_pos)
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    s = jnp.where(allowed[None], s.reshape(group, block_q, -1), MASK_VALUE).reshape(s.shape)
    m_prev = m_ref[:, :1]
    m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_next)
    alpha = jnp.exp(m_prev - m_next)
    l_ref[...] = jnp.broadcast_to(alpha * l_ref[:, :1] + p.sum(axis=1, keepdims=True), l_ref.shape)
    m_ref[...] = jnp.broadcast_to(m_next, m_ref.shape)
    v = v_ref[...].reshape(keys, head_dim).astype(jnp.float32)
    acc_ref[...] = alpha * acc_ref[...] + jnp.dot(p, v, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_q",
                                             "block_k", "interpret"))
def prefill_attention(q, k_pages, v_pages, context_slots, key_positions, key_segments,
                      query_positions, query_segments, *, scale: float,
                      soft_cap: Optional[float] = None, sliding_window: Optional[int] = None,
                      block_q: Optional[int] = None, block_k: Optional[int] = None,
                      interpret: bool = False):
    """Segment-causal packed prefill attention; see ``reference.prefill_attention`` and the key
    layout above."""
    check_attention_operands("prefill_attention", q, k_pages, v_pages)
    num_tokens, heads, head_dim = q.shape
    kv_heads, num_pages, block_size, _ = k_pages.shape
    dtype_name = jnp.dtype(q.dtype).name
    default_q, default_k = choose_blocks(num_tokens, context_slots.shape[0], dtype_name)
    block_q, block_k = block_q or default_q, block_k or default_k
    validate(q.shape, k_pages.shape, dtype_name, block_q, block_k)
    tokens_p = _round_up(num_tokens, block_q)
    keys_p = _round_up(context_slots.shape[0], block_k)

    def pad(x, size, value):
        return jnp.pad(x.astype(jnp.int32), (0, size - x.shape[0]), constant_values=value)

    # Our padding gets segments no caller uses (-2 queries, -3 keys): never attended.
    q_pos, q_seg = pad(query_positions, tokens_p, 0), pad(query_segments, tokens_p, -2)
    k_pos, k_seg = pad(key_positions, keys_p, 0), pad(key_segments, keys_p, -3)
    # The page of each run of block_size keys (the layout puts a run in one page).
    pages = jnp.clip(pad(context_slots, keys_p, 0)[::block_size] // block_size, 0, num_pages - 1)
    group = heads // kv_heads
    qg = jnp.pad(q, ((0, tokens_p - num_tokens), (0, 0), (0, 0)))
    qg = qg.reshape(tokens_p, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    needed = blocks_needed(q_pos, q_seg, k_pos, k_seg, block_q, block_k, sliding_window)
    cost = cost_estimate(num_tokens, context_slots.shape[0], heads, k_pages.shape, (block_q, block_k),
                         q.dtype.itemsize, k_pages.dtype.itemsize, soft_cap, sliding_window)
    out = _call(needed, pages, qg, k_pages, v_pages, q_pos, q_seg, k_pos, k_seg, block_q, block_k,
                dict(scale=scale, soft_cap=soft_cap, sliding_window=sliding_window), cost, interpret)
    return out.transpose(2, 0, 1, 3).reshape(tokens_p, heads, head_dim)[:num_tokens]


def _call(needed, pages, qg, k_pages, v_pages, q_pos, q_seg, k_pos, k_seg, block_q, block_k, options, cost,
          interpret):
    kv_heads, group, tokens_p, head_dim = qg.shape
    block_size = k_pages.shape[2]
    keys_p = k_pos.shape[0]
    q_spec = pl.BlockSpec((None, group, block_q, head_dim), lambda h, i, j, needed, pages: (h, 0, i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    q_meta = pl.BlockSpec((block_q, LANES), lambda h, i, j, needed, pages: (i, 0))
    k_meta = pl.BlockSpec((SUBLANES, block_k), lambda h, i, j, needed, pages: (0, j))
    rows = group * block_q
    slots = (2, block_k // block_size, block_size, head_dim)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(kv_heads, tokens_p // block_q, keys_p // block_k),
        in_specs=[q_spec, any_spec, any_spec, q_meta, q_meta, k_meta, k_meta], out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM(slots, k_pages.dtype), pltpu.VMEM(slots, v_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2)),
                        pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, LANES), jnp.float32),
                        pltpu.VMEM((rows, head_dim), jnp.float32)])
    lanes = lambda x: jnp.broadcast_to(x[:, None], (x.shape[0], LANES))  # noqa: E731
    sublanes = lambda x: jnp.broadcast_to(x[None, :], (SUBLANES, x.shape[0]))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_kernel, **options), grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(needed, pages, qg, k_pages, v_pages, lanes(q_pos), lanes(q_seg), sublanes(k_pos), sublanes(k_seg))


def one_prompt_layout(num_tokens: int, num_keys: int, block_q: int, block_k: int):
    """(q_pos, q_seg, k_pos, k_seg) as ``prefill_attention`` pads them, for one prompt that fills
    the call: key i at position i, query t at position ``num_keys - num_tokens + t``."""
    tokens_p, keys_p = _round_up(num_tokens, block_q), _round_up(num_keys, block_k)
    real_q, real_k = np.arange(tokens_p) < num_tokens, np.arange(keys_p) < num_keys
    q_pos = np.where(real_q, np.maximum(np.arange(tokens_p) + num_keys - num_tokens, 0), 0)
    k_pos = np.where(real_k, np.arange(keys_p), 0)
    return q_pos, np.where(real_q, 0, -2), k_pos, np.where(real_k, 0, -3)


def cost_estimate(num_tokens: int, num_keys: int, heads: int, pages_shape, blocks, itemsize: int,
                  kv_itemsize: int, soft_cap: Optional[float], sliding_window: Optional[int]) -> pl.CostEstimate:
    """What the grid DMAs and computes for ``one_prompt_layout`` (the flags ``blocks_needed``
    gives it; the real ones are traced): per KV head and query block, each needed key block's
    pages of K and V; q and the output once per (KV head, query block); the query positions and
    segments once per query block (once in all with one block), the key ones once per grid step
    (once with one key block); the flags and page ids once into SMEM. Flops: both matmuls of
    each visited tile, masked entries included; transcendentals: an exp per score (and a tanh
    with a soft cap), an exp per row per visited tile."""
    kv_heads, _, block_size, head_dim = pages_shape
    block_q, block_k = blocks
    q_blocks, k_blocks = -(-num_tokens // block_q), -(-num_keys // block_k)
    visited = int(blocks_needed(*one_prompt_layout(num_tokens, num_keys, block_q, block_k),
                                block_q, block_k, sliding_window).sum())
    q_meta = (kv_heads * q_blocks if q_blocks > 1 else 1) * block_q * LANES * 4
    k_meta = (kv_heads * q_blocks * k_blocks if k_blocks > 1 else 1) * SUBLANES * block_k * 4
    smem = (q_blocks * k_blocks + k_blocks * block_k // block_size) * 4
    accessed = (kv_heads * visited * 2 * block_k * head_dim * kv_itemsize + 2 * q_blocks * block_q * heads * head_dim
                * itemsize + 2 * (q_meta + k_meta) + smem)
    scores = visited * heads * block_q * block_k
    return pl.CostEstimate(flops=4 * scores * head_dim,
                           transcendentals=scores * (2 if soft_cap is not None else 1) + visited * heads * block_q,
                           bytes_accessed=accessed)
