"""Weight-only quantized matmul (INT8 ``w8a16_matmul``, INT4 ``w4a16_matmul``) as a Pallas TPU
kernel: the weights stream from HBM in their quantized bytes and become ``x``'s dtype in VMEM.

out = x @ dequantize(weight), with the contracts of ``w8a16_matmul/reference.py`` and
``w4a16_matmul/reference.py``.

How it works: grid (m-tile, n-tile, k-tile), k innermost, an fp32 accumulator in VMEM. Each
step DMAs an int8 weight tile (INT4: a tile of packed bytes, each byte two weights) and its
scales. The MXU multiplies the activations by the integer values themselves (exact in bf16:
|q| <= 127, or |q - zero| <= 23) and the scale is applied to the fp32 partial product: once per
output column at the end for per-channel INT8, per group of ``group`` input features (a
multiple of 128, so a group is whole lanes of x) for group-wise scales. INT4 bytes hold input
feature i in the low nibble and i + k/2 in the high one: x is passed twice with index maps a
half apart, so the two nibbles of a tile meet their own activations without any relayout.

TPU constraints (``problem`` names the first one shapes break): tk a multiple of 128 (and of
the group) dividing k (INT4: half of k); tn a multiple of 128 dividing n, as wide as VMEM
allows (x is fetched again for each n-tile); tm the whole m or a multiple of 16 dividing it;
groups of a multiple of 128 input features; blocks within the VMEM budget (double-buffered x,
weight and output tiles, the accumulator and the tile's values in fp32).
The cost estimate counts the bytes the grid DMAs: x once per n-tile, the quantized weight and
scales once per m-tile, the output once.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_executor.kernels.tpu_layout import LANES, VMEM_BUDGET_BYTES


def _divisor_tile(dim: int, multiple: int, largest: int) -> Optional[int]:
    """The largest multiple of ``multiple`` up to ``largest`` dividing ``dim`` (None: none)."""
    for tile in range(largest - largest % multiple, 0, -multiple):
        if dim % tile == 0:
            return tile
    return None


def tiles(m: int, k_rows: int, n: int, group: int,
          itemsize: int = 2) -> Tuple[Optional[int], Optional[int], Optional[int]]:
    """Default (tm, tk, tn): ``k_rows`` is the weight's stored rows (INT4: half of k). tn is
    as wide as VMEM allows (up to 2,048): each n-tile reads x again."""
    tm = m if m <= 256 else _divisor_tile(m, 16, 256)
    tk = _divisor_tile(k_rows, max(LANES, group if group < k_rows else LANES), 512)
    tn = None
    for largest in (2048, 1024, 512, 256, 128):
        tn = _divisor_tile(n, LANES, largest)
        if tm is None or tk is None or tn is None or vmem_bytes(tm, tk, tn, itemsize) <= VMEM_BUDGET_BYTES:
            break
    return tm, tk, tn


def vmem_bytes(tm: int, tk: int, tn: int, itemsize: int) -> int:
    """Double-buffered x (both halves), weight and output tiles, the fp32 accumulator and the
    tile's integer values in fp32."""
    return 2 * (2 * tm * tk * itemsize + tk * tn + tm * tn * itemsize) + tm * tn * 4 + 2 * tk * tn * 4


def problem(m: int, k_rows: int, n: int, group: int, itemsize: int) -> Optional[str]:
    """Why the kernel cannot take these shapes (None: it can). ``group``: input features per
    scale (``k`` for per-channel scales)."""
    tm, tk, tn = tiles(m, k_rows, n, group, itemsize)
    if group < k_rows and group % LANES:
        return f"groups of {group} input features are not whole lanes (a multiple of {LANES})"
    if tm is None or tk is None or tn is None:
        return f"no tiling of m={m}, k={k_rows} stored rows, n={n} in multiples of (16, {LANES}, {LANES})"
    need = vmem_bytes(tm, tk, tn, itemsize)
    if need > VMEM_BUDGET_BYTES:
        return f"tiles ({tm}, {tk}, {tn}) need {need} bytes of VMEM, over {VMEM_BUDGET_BYTES}"
    return None


def scaled_dot(x, q, scale, zero, group: int, dtype):
    """sum over the tile's groups of (x_g @ (q_g - zero_g)) * scale_g, fp32 [tm, tn]."""
    total = None
    for g in range(q.shape[0] // group):
        rows = slice(g * group, (g + 1) * group)
        values = q[rows].astype(jnp.float32)
        if zero is not None:
            values = values - zero[g][None, :]
        part = jnp.dot(x[:, rows], values.astype(dtype), preferred_element_type=jnp.float32) * scale[g][None, :]
        total = part if total is None else total + part
    return total


def _kernel(*refs, bits: int, group: int, per_channel: bool, has_zero: bool):
    """One (m, n, k) step; refs: x (INT4: its low and high halves), weight, scales (INT4: low,
    high), zeros if any (likewise), the output and the accumulator."""
    halves = 2 if bits == 4 else 1
    xs, (w_ref,), rest = refs[:halves], refs[halves:halves + 1], refs[halves + 1:]
    scales, rest = rest[:halves], rest[halves:]
    zeros, (out_ref, acc_ref) = (rest[:halves], rest[halves:]) if has_zero else ((None,) * halves, rest)

    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    dtype = xs[0].dtype
    stored = w_ref[...].astype(jnp.int32)
    values = [stored] if bits == 8 else [(stored << 28) >> 28, stored >> 4]  # sign-extended nibbles
    for x_ref, q, scale_ref, zero_ref in zip(xs, values, scales, zeros):
        if per_channel:
            acc_ref[...] += jnp.dot(x_ref[...], q.astype(jnp.float32).astype(dtype),
                                    preferred_element_type=jnp.float32)
        else:
            zero = None if zero_ref is None else zero_ref[...]
            acc_ref[...] += scaled_dot(x_ref[...], q, scale_ref[...], zero, group, dtype)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        result = acc_ref[...] * scales[0][0][None, :] if per_channel else acc_ref[...]
        out_ref[...] = result.astype(out_ref.dtype)


def _inputs(x, weight, scale, zero, tiling: Tuple[int, int, int], group: int, halves: int):
    """The kernel's operands and their block specs: x (once per half, the halves' k-tiles
    ``steps`` apart), the weight, then the scales and zeros (per half; group-wise ones as
    ``[k / tk, tk / group, n]`` so a k-tile's groups are one block)."""
    tm, tk, tn = tiling
    n, steps = weight.shape[1], weight.shape[0] // tk

    def half(h, i, j, s):
        return s + h * steps

    x_specs = [pl.BlockSpec((tm, tk), functools.partial(lambda h, i, j, s: (i, half(h, i, j, s)), h))
               for h in range(halves)]
    weight_spec = pl.BlockSpec((tk, tn), lambda i, j, s: (s, j))
    if scale.ndim == 1:
        return [x] * halves + [weight, scale.reshape(1, n)], \
            x_specs + [weight_spec, pl.BlockSpec((1, tn), lambda i, j, s: (0, j))]
    side = [scale] + ([] if zero is None else [zero])
    side_specs = [pl.BlockSpec((None, tk // group, tn),
                               functools.partial(lambda h, i, j, s: (half(h, i, j, s), 0, j), h))
                  for h in range(halves)]
    side_operands = [t.reshape(-1, tk // group, n) for t in side for _ in range(halves)]
    return [x] * halves + [weight] + side_operands, x_specs + [weight_spec] + side_specs * len(side)


@functools.partial(jax.jit, static_argnames=("bits", "interpret"))
def quantized_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, zero: Optional[jax.Array] = None, *,
                     bits: int, interpret: bool = False) -> jax.Array:
    """``x [m, k] @ dequantize(weight)``: ``bits`` 8 (``weight [k, n]`` int8, ``scale [n]`` or
    ``[k // group, n]``) or 4 (``weight [k // 2, n]`` packed, ``scale``/``zero [k // group, n]``)."""
    m, k = x.shape
    k_rows, n = weight.shape
    per_channel = scale.ndim == 1
    group = k if per_channel else k // scale.shape[0]
    halves = 2 if bits == 4 else 1
    reason = problem(m, k_rows, n, group, x.dtype.itemsize)
    if reason is not None:
        raise ValueError(f"quantized_matmul: {reason}")
    tm, tk, tn = tiles(m, k_rows, n, group, x.dtype.itemsize)
    operands, in_specs = _inputs(x, weight, scale, zero, (tm, tk, tn), group, halves)
    kernel = functools.partial(_kernel, bits=bits, group=group, per_channel=per_channel, has_zero=zero is not None)
    return pl.pallas_call(
        kernel, grid=(m // tm, n // tn, k_rows // tk), in_specs=in_specs,
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(m, k, n, k_rows, (tm, tk, tn), x.dtype.itemsize, scale, zero),
        interpret=interpret,
    )(*operands)


def cost_estimate(m: int, k: int, n: int, k_rows: int, tiling: Tuple[int, int, int], itemsize: int, scale, zero):
    """The bytes the grid DMAs and the MXU's flops. The pipeline fetches a block when its index
    changes: x (index m-tile, k-tile) once per n-tile unless one k-tile spans k; the weight,
    scales and zeros (k-tile, n-tile) once per m-tile unless the grid has a single (k, n) tile;
    the output once."""
    tm, tk, tn = tiling
    k_tiles, n_tiles, m_tiles = k_rows // tk, n // tn, m // tm
    side = scale.size * 4 + (0 if zero is None else zero.size * 4)
    x_reads = n_tiles if k_tiles > 1 else 1
    weight_reads = m_tiles if k_tiles * n_tiles > 1 else 1
    accessed = m * k * itemsize * x_reads + (k_rows * n + side) * weight_reads + m * n * itemsize
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0, bytes_accessed=accessed)

