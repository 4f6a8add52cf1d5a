"""Grouped matmul (MoE experts) as a Pallas TPU kernel.

out[rows of group g] = lhs[rows of group g] @ rhs[g], with the contract of ``reference.gmm``.

How it works: rows are cut into m-tiles of ``tm`` rows. A tile that straddles a group
boundary is visited once per group it holds, so the work list is a sequence of *visits*
(m-tile, group), in row order, computed on device with fixed shapes: at most
``m_tiles + groups - 1`` of them (the static grid size). Each visit multiplies the tile's
rows that belong to its group (the others are masked to zero) by that group's rhs tile and
adds into an fp32 accumulator that stays in VMEM while consecutive visits hit the same tile;
the tile is stored after its last visit. Tiles past the last group get one "empty" visit that
stores zeros. Surplus visits repeat the last tile with an empty group and do no matmul.

TPU constraints (checked in ``validate`` and documented where they bind):
- Block shapes: the last two dims of every block must be multiples of (8, 128) or the full
  array dims. tm is a multiple of 8 (16 for bf16, whose native tile packs two rows per
  sublane); tk and tn are multiples of 128 or the whole k / n.
- VMEM: the pipeline double-buffers the lhs, rhs and out blocks, plus one fp32 accumulator
  of tm x tn. That total must stay under the VMEM budget (``tpu_layout``) or Mosaic fails
  to allocate.
- SMEM: the visit list lives in SMEM as three int32 vectors of length ~(m_tiles + groups),
  far below its 1 MiB.
- The group dimension is looked up through scalar prefetch in the rhs index map, so an
  expert's weights are DMA'd only for visits that need them, once per (k, n) tile.

The cost estimate (``cost_estimate``) counts the grid's fetches with every expert holding rows
(the group sizes are traced; an estimate is a static number): the most a call fetches and
multiplies.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_executor.kernels.tpu_layout import (
    LANES,
    check_dtype,
    check_vmem,
    gmm_row_tile,
    itemsize,
    sublanes,
)
from tpu_executor.kernels.w8a16_matmul.kernel import scaled_dot


def _largest_tile(dim: int, preferred: Tuple[int, ...] = (512, 256, 128)) -> int:
    for tile in preferred:
        if dim % tile == 0:
            return tile
    return dim  # a block may always span the whole dimension


def choose_tiling(m: int, k: int, n: int, dtype_name: str) -> Tuple[int, int, int]:
    """Default (tm, tk, tn): up to 256 rows, the largest 128-multiple dividing k and n."""
    return gmm_row_tile(m, dtype_name), _largest_tile(k), _largest_tile(n)


def vmem_bytes(tm: int, tk: int, tn: int, itemsize: int) -> int:
    """Double-buffered lhs/rhs/out blocks plus the fp32 accumulator."""
    return 2 * (tm * tk + tk * tn + tm * tn) * itemsize + tm * tn * 4


def validate(m: int, k: int, n: int, groups: int, dtype_name: str,
             tiling: Tuple[int, int, int]) -> None:
    """Raise ValueError naming the first TPU constraint these shapes break."""
    tm, tk, tn = tiling
    check_dtype("gmm", dtype_name)
    if m < 1 or groups < 1:
        raise ValueError(f"gmm needs at least one row and one group, got m={m} groups={groups}")
    if tm % sublanes(dtype_name):
        raise ValueError(f"tm={tm} must be a multiple of {sublanes(dtype_name)} for {dtype_name}")
    for name, dim, tile in (("k", k, tk), ("n", n, tn)):
        if dim % tile or (tile % LANES and tile != dim):
            raise ValueError(f"t{name}={tile} must divide {name}={dim} and be a multiple of "
                             f"{LANES} (or all of {name})")
    check_vmem("gmm", vmem_bytes(tm, tk, tn, itemsize(dtype_name)), f"tiling {tiling}")


def visit_schedule(group_sizes: jax.Array, m: int, tm: int):
    """(row offsets [groups+2], visit groups [V], visit tiles [V]) with V = m_tiles + groups - 1.

    Group g owns rows [offsets[g], offsets[g+1]); group id ``groups`` is the empty group
    (offsets[groups] == offsets[groups+1]) used by visits that only store zeros.
    """
    groups = group_sizes.shape[0]
    m_tiles = m // tm
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), m)
    starts = jnp.concatenate([jnp.zeros(1, jnp.int32), ends[:-1]])
    total = ends[-1]
    first_tile = starts // tm
    counts = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)
    visits_done = jnp.cumsum(counts)  # visits up to and including group g
    group_visits = visits_done[-1]
    v = jnp.arange(m_tiles + groups - 1, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(visits_done, v, side="right"), groups - 1).astype(jnp.int32)
    in_group = v < group_visits
    tile_of_group = first_tile[g] + v - (visits_done[g] - counts[g])
    trailing_tile = jnp.minimum(-(-total // tm) + v - group_visits, m_tiles - 1)
    tiles = jnp.where(in_group, tile_of_group, trailing_tile)
    visit_groups = jnp.where(in_group, g, groups)
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), ends, total[None]])
    return offsets, visit_groups.astype(jnp.int32), tiles.astype(jnp.int32)


def _gmm_kernel(offsets, visit_groups, visit_tiles, *refs, tm: int, transpose_rhs: bool, form: str, group: int):
    """One (n-tile, visit, k-tile) step. refs: the inputs (plain: lhs, rhs; ``int8``: lhs, rhs,
    scale; ``int4``/``int4_zero``: lhs's two halves, rhs (packed), scales of both halves (zeros
    of both)), then the output and the accumulator."""
    *inputs, out_ref, acc_ref = refs
    v, k_i = pl.program_id(1), pl.program_id(2)
    last_v, last_k = pl.num_programs(1) - 1, pl.num_programs(2) - 1
    tile = visit_tiles[v]
    first_visit = jnp.logical_or(v == 0, visit_tiles[jnp.maximum(v - 1, 0)] != tile)
    last_visit = jnp.logical_or(v == last_v, visit_tiles[jnp.minimum(v + 1, last_v)] != tile)
    group_id = visit_groups[v]
    start, end = offsets[group_id], offsets[group_id + 1]

    @pl.when(jnp.logical_and(first_visit, k_i == 0))
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(end > start)
    def _accumulate():
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, inputs[0].shape, 0)
        inside = (rows >= start) & (rows < end)
        partial = _int4_partial if form.startswith("int4") else _partial
        acc_ref[...] += partial(inputs, inside, transpose_rhs, group)

    @pl.when(jnp.logical_and(last_visit, k_i == last_k))
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def _partial(inputs, inside, transpose_rhs: bool, group: int):
    """This visit's rows times its expert's tile, fp32 (INT8 experts: the levels through the
    MXU, exact in bf16, then the expert's per-channel scale: a tile's visits span experts)."""
    lhs_ref, rhs_ref, *scale_ref = inputs
    lhs = jnp.where(inside, lhs_ref[...], 0)
    contract = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    rhs = rhs_ref[...] if not scale_ref else rhs_ref[...].astype(jnp.float32).astype(lhs.dtype)
    partial = jax.lax.dot_general(lhs, rhs, (contract, ((), ())), preferred_element_type=jnp.float32)
    return partial * scale_ref[0][...] if scale_ref else partial


def _int4_partial(inputs, inside, transpose_rhs: bool, group: int):
    """INT4 experts: a byte of rhs holds input features i and i + k/2 (``w4a16_matmul``'s
    layout), so each half of the unpacked tile meets its own half of lhs; each group of
    ``group`` features is scaled (and shifted by its zero) on its fp32 partial product."""
    lhs_refs, rhs_ref, scales = inputs[:2], inputs[2], inputs[3:5]
    zeros = inputs[5:7] or (None, None)
    stored = rhs_ref[...].astype(jnp.int32)
    total = None
    for lhs_ref, q, scale_ref, zero_ref in zip(lhs_refs, ((stored << 28) >> 28, stored >> 4), scales, zeros):
        lhs = jnp.where(inside, lhs_ref[...], 0)
        zero = None if zero_ref is None else zero_ref[...]
        part = scaled_dot(lhs, q, scale_ref[...], zero, group, lhs.dtype)
        total = part if total is None else total + part
    return total


def rhs_form(k: int, rhs_shape, transpose_rhs: bool, scales: int) -> str:
    """``plain`` (rhs in lhs's dtype), ``int8`` (int8 levels, per-channel scales) or ``int4``
    / ``int4_zero`` (two levels a byte: rhs has k / 2 rows; group scales, and zeros)."""
    if scales == 0:
        return "plain"
    if not transpose_rhs and rhs_shape[1] * 2 == k:
        return "int4_zero" if scales == 2 else "int4"
    return "int8"


def int4_problem(k: int, group: int, tk: int) -> Optional[str]:
    """Why INT4 experts' groups do not fit the kernel's k-tiles (None: they do)."""
    if group % LANES or tk % group:
        return f"INT4 groups of {group} input features must be whole lanes ({LANES}) within tk={tk}"
    return None


@functools.partial(jax.jit, static_argnames=("transpose_rhs", "tiling", "interpret"))
def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *side: jax.Array, transpose_rhs: bool = False,
        tiling: Optional[Tuple[int, int, int]] = None, interpret: bool = False) -> jax.Array:
    """Grouped matmul; see ``reference.gmm`` for the contract and the module doc for tiling.
    ``side``: INT8 experts' per-channel scales, or INT4 experts' group scales (and zeros): the
    quantized tiles stream as stored."""
    m, k = lhs.shape
    groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    form = rhs_form(k, rhs.shape, transpose_rhs, len(side))
    k_rows = k // 2 if form.startswith("int4") else k
    if rhs.shape[2 if transpose_rhs else 1] != k_rows or rhs.dtype != (lhs.dtype if form == "plain" else jnp.int8):
        raise ValueError(f"rhs {rhs.dtype}{rhs.shape} does not fit lhs {lhs.dtype}{lhs.shape} "
                         f"(transpose_rhs={transpose_rhs})")
    if group_sizes.shape != (groups,):
        raise ValueError(f"group_sizes must have shape ({groups},), got {group_sizes.shape}")
    tiling = tiling or choose_tiling(m, k_rows, n, jnp.dtype(lhs.dtype).name)
    validate(m, k_rows, n, groups, jnp.dtype(lhs.dtype).name, tiling)
    group = k // side[0].shape[1] if form.startswith("int4") else k
    if form.startswith("int4") and int4_problem(k, group, tiling[1]):
        raise ValueError(int4_problem(k, group, tiling[1]))
    tm = tiling[0]
    padded_m = -(-m // tm) * tm  # pad rows to whole tiles; padding rows are in no group
    lhs = jnp.pad(lhs, ((0, padded_m - m), (0, 0)))
    schedule = visit_schedule(group_sizes, padded_m, tm)
    out = _call(lhs, rhs, side, schedule, n, tiling, transpose_rhs, interpret, form, group)
    return out[:m]


def _int4_inputs(lhs, rhs, side, tiling, group):
    """INT4's operands and block specs: lhs twice (its halves' k-tiles ``steps`` apart), the
    packed rhs, then each side tensor (scales, zeros) twice, as ``[G, k / tk, tk / group, n]``
    so that a k-tile's groups are one block."""
    tm, tk, tn = tiling
    groups, steps, n = rhs.shape[0], rhs.shape[1] // tk, rhs.shape[2]

    def expert(v, visit_groups):
        return jnp.minimum(visit_groups[v], groups - 1)

    lhs_specs = [pl.BlockSpec((tm, tk), functools.partial(lambda h, n_i, v, k_i, o, g, t: (t[v], k_i + h * steps), h))
                 for h in (0, 1)]
    rhs_spec = pl.BlockSpec((None, tk, tn), lambda n_i, v, k_i, o, g, t: (expert(v, g), k_i, n_i))
    side_specs = [pl.BlockSpec((None, None, tk // group, tn), functools.partial(
        lambda h, n_i, v, k_i, o, g, t: (expert(v, g), k_i + h * steps, 0, n_i), h)) for h in (0, 1)]
    side_operands = [s.reshape(groups, -1, tk // group, n) for s in side for _ in (0, 1)]
    return [lhs, lhs, rhs] + side_operands, lhs_specs + [rhs_spec] + side_specs * len(side)


def _call(lhs, rhs, side, schedule, n, tiling, transpose_rhs, interpret, form, group):
    tm, tk, tn = tiling
    groups = rhs.shape[0]
    num_visits = schedule[1].shape[0]
    k_rows = rhs.shape[2 if transpose_rhs else 1]
    grid = (n // tn, num_visits, k_rows // tk)

    def rhs_map(n_i, v, k_i, offsets, visit_groups, visit_tiles):
        group = jnp.minimum(visit_groups[v], groups - 1)  # the empty group reads any matrix
        return (group, n_i, k_i) if transpose_rhs else (group, k_i, n_i)

    def scale_map(n_i, v, k_i, offsets, visit_groups, visit_tiles):
        return jnp.minimum(visit_groups[v], groups - 1), 0, n_i

    rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
    if form.startswith("int4"):
        operands, in_specs = _int4_inputs(lhs, rhs, side, tiling, group)
    else:
        scales = [s.reshape(groups, 1, n) for s in side]
        operands = [lhs, rhs, *scales]
        in_specs = [pl.BlockSpec((tm, tk), lambda n_i, v, k_i, o, g, t: (t[v], k_i)),
                    pl.BlockSpec(rhs_block, rhs_map)] + [pl.BlockSpec((None, 1, tn), scale_map)] * len(scales)
    cost = cost_estimate(lhs.shape[0], lhs.shape[1], n, groups, tiling, form, lhs.dtype.itemsize,
                         rhs.dtype.itemsize, [s.dtype.itemsize for s in side], group)
    spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=grid, in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda n_i, v, k_i, o, g, t: (t[v], n_i)),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)])
    kernel = functools.partial(_gmm_kernel, tm=tm, transpose_rhs=transpose_rhs, form=form, group=group)
    return pl.pallas_call(
        kernel, grid_spec=spec,
        out_shape=jax.ShapeDtypeStruct((lhs.shape[0], n), lhs.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
    )(*schedule, *operands)


def cost_estimate(m: int, k: int, n: int, groups: int, tiling: Tuple[int, int, int], form: str, itemsize: int,
                  rhs_itemsize: int, side_itemsizes=(), group: Optional[int] = None) -> pl.CostEstimate:
    """What the grid (n-tile, visit, k-tile) fetches and multiplies, ``m`` rows padded to whole
    tiles, with every expert holding rows (group sizes are traced): the most a call does. The
    pipeline fetches a block when its index changes. With several k-tiles, lhs, rhs and INT4's
    scales and zeros change at every step: fetched ``m_tiles + groups - 1`` visits x k-tiles per
    n-tile (the visits of the empty group fetch too). With one k-tile, lhs (and the output) once
    per row tile per n-tile (lhs once in all with one row tile), and an expert's tiles, like
    INT8's per-channel scales always, once per run of its visits (at most ``groups`` per n-tile).
    Flops: each visit's masked tile product (``2 tm k tn``), at most every visit."""
    tm, tk, tn = tiling
    halves = 2 if form.startswith("int4") else 1
    k_tiles, n_tiles, m_tiles = k // halves // tk, n // tn, m // tm
    visits = m_tiles + groups - 1
    every_step = n_tiles * visits * k_tiles
    lhs_reads = every_step if k_tiles > 1 else (n_tiles * m_tiles if m_tiles > 1 else 1)
    expert_reads = every_step if k_tiles > 1 else n_tiles * groups
    accessed = halves * lhs_reads * tm * tk * itemsize + expert_reads * tk * tn * rhs_itemsize + m * n * itemsize
    for side in side_itemsizes:  # INT8: a [1, tn] scale row; INT4: scales, zeros of each half's groups
        accessed += n_tiles * groups * tn * side if halves == 1 else 2 * expert_reads * tk // group * tn * side
    accessed += (groups + 2 + 2 * visits) * 4  # the visit list, into SMEM
    return pl.CostEstimate(flops=2 * visits * tm * k * n, transcendentals=0, bytes_accessed=accessed)
