"""The ``gmm`` op: its spec (reference, fake, tolerances, cases) and its providers."""
from __future__ import annotations

import functools

import numpy as np
import torch

from tpu_executor.kernels.binding import eager_only, first_problem, jax_backed_op, jax_tpu_provider, tpu_provider
from tpu_executor.kernels.gmm import reference
from tpu_executor.kernels.mesh_split import EXPERT_WEIGHTS
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.tpu_layout import gmm_row_tile, torch_dtype_name
from tpu_executor.kernels.w4a16_matmul.reference import quantize_int4
from tpu_executor.kernels.w8a16_matmul.reference import quantize_per_channel

OP_NAME = "gmm"
KERNEL_MODULE = "tpu_executor.kernels.gmm.kernel"
SCHEMA = ("(Tensor lhs, Tensor rhs, Tensor group_sizes, *, bool transpose_rhs=False, str? tp_split=None, "
          "bool interpret=False) -> Tensor")
SCALED_SCHEMA = ("(Tensor lhs, Tensor rhs, Tensor group_sizes, Tensor rhs_scale, *, bool transpose_rhs=False, "
                 "str? tp_split=None, bool interpret=False) -> Tensor")
ZERO_SCHEMA = ("(Tensor lhs, Tensor rhs, Tensor group_sizes, Tensor rhs_scale, Tensor rhs_zero, *, "
               "bool transpose_rhs=False, str? tp_split=None, bool interpret=False) -> Tensor")


def fake(lhs, rhs, group_sizes, rhs_scale=None, rhs_zero=None, *, transpose_rhs=False, tp_split=None):
    """Output shape and dtype, for tracing providers that are opaque custom calls."""
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    return lhs.new_empty(lhs.shape[0], n)


def generate_case(rng: np.random.Generator) -> OpCase:
    """Ragged groups (some empty, rows past the last group) over TPU-legal k and n; a fifth of
    the cases INT8 experts, a fifth INT4 experts (k = 256: half of k one group of 128)."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    groups = int(rng.choice([1, 2, 4, 8]))
    m = int(rng.choice([8, 24, 40, 64, 128, 200, 256, 512]))
    k, n = int(rng.choice([128, 256, 384])), int(rng.choice([128, 256]))
    transpose_rhs = bool(rng.random() < 0.5)
    form = rng.random()
    if 0.2 <= form < 0.4:
        k, transpose_rhs = 256, False
    total = m - int(rng.integers(0, m // 4 + 1))
    weights = rng.random(groups) * (rng.random(groups) > 0.25)  # about a quarter empty
    if weights.sum() == 0:
        weights[0] = 1.0
    sizes = rng.multinomial(total, weights / weights.sum()).astype(np.int32)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    lhs = torch.randn(m, k, generator=gen).to(dtype)
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    rhs = (torch.randn(*rhs_shape, generator=gen) / k ** 0.5).to(dtype)
    label = f"m={m} k={k} n={n} sizes={sizes.tolist()} T={transpose_rhs} {dtype}"
    if form < 0.2:  # INT8 experts, a scale per output channel
        levels, scale = quantize_per_channel(rhs.float().transpose(1, 2) if transpose_rhs else rhs.float())
        rhs = levels.transpose(1, 2).contiguous() if transpose_rhs else levels
        return OpCase((lhs, rhs, torch.from_numpy(sizes), scale), {"transpose_rhs": transpose_rhs}, f"{label} int8")
    if form < 0.4:  # INT4 experts in groups of 128, symmetric or with zero points
        packed, scale, zero = quantize_int4(rhs.float(), 128, symmetric=form < 0.3)
        side = (scale,) if zero is None else (scale, zero)
        return OpCase((lhs, packed, torch.from_numpy(sizes), *side), {}, f"{label} int4 zero={zero is not None}")
    return OpCase((lhs, rhs, torch.from_numpy(sizes)), {"transpose_rhs": transpose_rhs}, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.gmm, fake=fake, generate=generate_case,
    # fp32: accumulation order only. bf16: the output is rounded to bf16 (2**-8 relative).
    tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def shape_problem(lhs, rhs, group_sizes, *side, transpose_rhs=False, tp_split=None, require_whole_tiles=False):
    """Why our kernel's TPU constraints reject these tensors, or None when they fit."""
    from tpu_executor.kernels.gmm import kernel

    if lhs.dim() != 2 or rhs.dim() != 3 or group_sizes.dim() != 1:
        return f"gmm wants lhs [m, k], rhs 3-D and group_sizes 1-D, got {lhs.dim()}/{rhs.dim()}/{group_sizes.dim()}"
    if group_sizes.dtype != torch.int32 or rhs.dtype != (torch.int8 if side else lhs.dtype):
        return (f"gmm wants int32 group sizes and rhs in lhs's dtype (int8 with scales), got {group_sizes.dtype}, "
                f"{lhs.dtype}, {rhs.dtype}")
    m, k = lhs.shape
    form = kernel.rhs_form(k, rhs.shape, transpose_rhs, len(side))
    k_rows = k // 2 if form.startswith("int4") else k
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if rhs.shape[2 if transpose_rhs else 1] != k_rows or group_sizes.shape[0] != rhs.shape[0]:
        return f"gmm shapes do not fit: lhs {list(lhs.shape)}, rhs {list(rhs.shape)}, groups {list(group_sizes.shape)}"
    dtype_name = torch_dtype_name(lhs)
    tiling = kernel.choose_tiling(m, k_rows, n, dtype_name)
    if require_whole_tiles and m % tiling[0]:
        return f"m={m} is not a multiple of tm={tiling[0]}"
    if form.startswith("int4") and kernel.int4_problem(k, k // side[0].shape[1], tiling[1]):
        return kernel.int4_problem(k, k // side[0].shape[1], tiling[1])
    return first_problem(lambda: kernel.validate(m, k_rows, n, rhs.shape[0], dtype_name, tiling))


def _pallas_gmm(lhs, rhs, group_sizes, *side, transpose_rhs=False, tp_split=None, interpret=False):
    from tpu_executor.kernels.gmm import kernel

    return kernel.gmm(lhs, rhs, group_sizes, *side, transpose_rhs=transpose_rhs, interpret=interpret)


def _megablox_gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, tp_split=None, interpret=False):
    """JAX's shipped kernel, adapted to our contract: rows past the last group are zero
    (megablox leaves them undefined)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    from tpu_executor.kernels.gmm import kernel

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiling = kernel.choose_tiling(m, k, n, jnp.dtype(lhs.dtype).name)
    out = megablox_gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=tiling,
                       transpose_rhs=transpose_rhs, interpret=interpret)
    covered = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(covered, out, 0).astype(lhs.dtype)


def _eager_gmm(lhs, rhs, group_sizes, rhs_scale=None, rhs_zero=None, *, transpose_rhs=False, tp_split=None):
    """Only each group's real rows times its matrix, by slicing on the group sizes: the
    reference's cost without its ``groups``-fold work. Data-dependent shapes, so it serves
    eager (untraced) CPU/GPU calls only - the native path."""
    out = lhs.new_zeros(lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2])
    start = 0
    for group, size in enumerate(group_sizes.tolist()):
        end = min(start + size, lhs.shape[0])
        if end > start:
            side = [None if s is None else s[group:group + 1] for s in (rhs_scale, rhs_zero)]
            weight = reference.expert_weights(lhs.shape[1], rhs[group:group + 1], *side, transpose_rhs)[0]
            out[start:end] = (lhs[start:end].float() @ weight).to(lhs.dtype)
        start = end
    return out


@functools.lru_cache(maxsize=None)
def pallas_op():
    """``torch.ops.tpu_executor.gmm_pallas`` (and ``gmm_pallas_scaled``, INT8 experts): our
    kernel bound through call_jax; a call picks the op of its form. Built once."""
    ops = {3: jax_backed_op("gmm_pallas", SCHEMA, _pallas_gmm, fake),
           4: jax_backed_op("gmm_pallas_scaled", SCALED_SCHEMA, _pallas_gmm, fake),
           5: jax_backed_op("gmm_pallas_zero", ZERO_SCHEMA, _pallas_gmm, fake)}
    return lambda *args, **kwargs: ops[len(args)](*args, **kwargs)


def megablox_op():
    """``torch.ops.tpu_executor.gmm_megablox``: JAX's shipped kernel through call_jax."""
    return jax_backed_op("gmm_megablox", SCHEMA, _megablox_gmm, fake)


def register(registry=REGISTRY) -> None:
    """Our Pallas kernel first (through torch_xla, or inline on the JAX path), then megablox
    (TPU), the eager slicing path for untraced non-XLA calls, then the reference (which accepts
    everything)."""
    registry.register(OP_NAME, tpu_provider("pallas", 20, pallas_op, shape_problem,
                                            sources=(KERNEL_MODULE,)))
    registry.register(OP_NAME, jax_tpu_provider("pallas_jax", 20, _pallas_gmm, shape_problem, sources=(KERNEL_MODULE,),
                                                split=EXPERT_WEIGHTS))
    registry.register(OP_NAME, tpu_provider(
        "jax_megablox", 10, megablox_op,
        lambda *a, **kw: "megablox takes no INT8 experts" if len(a) > 3 else shape_problem(*a, require_whole_tiles=True,
                                                                                           **kw),
        sources=(KERNEL_MODULE, "jax.experimental.pallas.ops.tpu.megablox.gmm")))
    registry.register(OP_NAME, Provider("eager_grouped", _eager_gmm, priority=5, supports_args=eager_only))
    registry.register(OP_NAME, Provider("reference", reference.gmm, priority=0, is_reference=True))


def padded_rows(m: int, dtype: torch.dtype) -> int:
    """How many rows an lhs of ``m`` rows should be padded to (zero rows past the last group)
    so that the kernels' row tile divides it: the MoE layer pads every bucket this way."""
    tile = gmm_row_tile(m, str(dtype).removeprefix("torch."))
    return -(-m // tile) * tile


def gmm(lhs, rhs, group_sizes, *side, transpose_rhs=False, tp_split=None):
    """Grouped matmul; see ``reference.gmm`` for the contract (``side``: quantized experts'
    scales, and INT4's zeros; kernels take tensors, so a missing one is not passed).
    ``tp_split`` says how ``rhs`` is split over tensor-parallel chips ("columns": its output
    features, "rows": its input features, as ``lhs``'s): the JAX path runs the kernel per chip
    by it."""
    side = tuple(s for s in side if s is not None)
    return REGISTRY.dispatch(OP_NAME, lhs, rhs, group_sizes, *side, transpose_rhs=transpose_rhs, tp_split=tp_split)
