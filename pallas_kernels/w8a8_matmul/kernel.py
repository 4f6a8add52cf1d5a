"""INT8 x INT8 matmul (W8A8, ``w8a8_matmul``) as a Pallas TPU kernel: the MXU multiplies INT8
activations by INT8 weights into an int32 accumulator (v5e and v6e multiply INT8 at twice
their bf16 rate), and the per-token and per-channel scales are applied once at the end.

out = ``w8a8_matmul/reference.py``'s contract. The activations are quantized per token before
the call (an elementwise pass XLA fuses); the kernel takes int8 x, int8 weight, x's scales
``[m, 1]`` and the weight's ``[1, n]``. Grid (m-tile, n-tile, k-tile), k innermost; the tiles
are the weight-only kernel's (``w8a16_matmul/kernel.py``) for one-byte activations, and so is
its cost estimate counts the bytes its grid DMAs in the same way.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_executor.kernels.w8a16_matmul.kernel import problem, tiles


def quantize_per_token(x: jax.Array):
    """(int8 ``[m, k]``, fp32 ``[m]``), as the reference quantizes."""
    rows = x.astype(jnp.float32)
    x_scale = jnp.maximum(jnp.max(jnp.abs(rows), axis=-1), 1e-12) / 127.0
    return jnp.clip(jnp.round(rows / x_scale[:, None]), -127, 127).astype(jnp.int8), x_scale


def _kernel(x_ref, w_ref, x_scale_ref, w_scale_ref, out_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.int32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        out_ref[...] = (acc_ref[...].astype(jnp.float32) * x_scale_ref[...] * w_scale_ref[...]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def w8a8_matmul(x: jax.Array, weight: jax.Array, scale: jax.Array, *, interpret: bool = False) -> jax.Array:
    """``x [m, k]`` (fp32/bf16) quantized per token, times ``weight [k, n]`` int8 with ``scale [n]``."""
    m, k = x.shape
    n = weight.shape[1]
    reason = problem(m, k, n, k, 1)
    if reason is not None:
        raise ValueError(f"w8a8_matmul: {reason}")
    tm, tk, tn = tiles(m, k, n, k, 1)
    x_q, x_scale = quantize_per_token(x)
    return pl.pallas_call(
        _kernel, grid=(m // tm, n // tn, k // tk),
        in_specs=[pl.BlockSpec((tm, tk), lambda i, j, s: (i, s)), pl.BlockSpec((tk, tn), lambda i, j, s: (s, j)),
                  pl.BlockSpec((tm, 1), lambda i, j, s: (i, 0)), pl.BlockSpec((1, tn), lambda i, j, s: (0, j))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j, s: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        scratch_shapes=[pltpu.VMEM((tm, tn), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost_estimate(m, k, n, (tm, tk, tn), x.dtype.itemsize),
        interpret=interpret,
    )(x_q, weight, x_scale.reshape(m, 1), scale.reshape(1, n))


def cost_estimate(m: int, k: int, n: int, tiling, out_itemsize: int) -> pl.CostEstimate:
    """The bytes the grid DMAs (a block is fetched when its index changes): x (m-tile, k-tile)
    once per n-tile unless one k-tile spans k, its scales (m-tile) once; the weight (k-tile,
    n-tile) once per m-tile unless the grid has a single (k, n) tile, its scales (n-tile) once
    per m-tile unless one n-tile spans n; the output once."""
    tm, tk, tn = tiling
    k_tiles, n_tiles, m_tiles = k // tk, n // tn, m // tm
    x_reads = n_tiles if k_tiles > 1 else 1
    weight_reads = m_tiles if k_tiles * n_tiles > 1 else 1
    accessed = m * k * x_reads + m * 4 + k * n * weight_reads + n * 4 * (m_tiles if n_tiles > 1 else 1) \
        + m * n * out_itemsize
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0, bytes_accessed=accessed)
