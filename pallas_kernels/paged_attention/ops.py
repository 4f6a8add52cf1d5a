"""The ``paged_attention`` op: its spec (reference, fake, tolerances, cases) and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.binding import eager_only, first_problem, jax_backed_op, jax_tpu_provider, tpu_provider
from tpu_executor.kernels.mesh_split import HEADS
from tpu_executor.kernels.paged_attention import cpu_native, eager, reference
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.tpu_layout import check_attention_operands, torch_dtype_name

OP_NAME = "paged_attention"
SCHEMA = ("(Tensor q, Tensor k_pages, Tensor v_pages, Tensor context_lens, Tensor block_tables, *, "
          "float scale, float? soft_cap=None, int? sliding_window=None, bool interpret=False) -> Tensor")
KERNEL_MODULE = "tpu_executor.kernels.paged_attention.kernel"


def fake(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
         sliding_window=None):
    """Output shape and dtype, for tracing providers that are opaque custom calls."""
    return torch.empty_like(q)


def random_block_tables(rng: np.random.Generator, lens, block_size: int, width: int):
    """Distinct random pages for every sequence, zero past each context; returns (tables, pages)."""
    needed = [-(-int(n) // block_size) for n in lens]
    num_blocks = sum(needed) + int(rng.integers(1, 8))
    order = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), width), np.int32)
    used = 0
    for row, count in enumerate(needed):
        tables[row, :count] = order[used:used + count]
        used += count
    return torch.from_numpy(tables), num_blocks


def generate_case(rng: np.random.Generator) -> OpCase:
    """Ragged contexts over TPU-legal pages, GQA groups, soft-cap and window on and off, one
    query per sequence (a decode) or several (a verify, some longer than short contexts)."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    kv_heads, group = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2, 4]))
    head_dim, block_size = int(rng.choice([128, 256])), int(rng.choice([16, 32]))
    batch = int(rng.integers(1, 7))
    lens = rng.integers(1, int(rng.choice([40, 100, 300])) + 1, size=batch)
    width = -(-int(lens.max()) // block_size) + int(rng.integers(0, 3))
    tables, num_blocks = random_block_tables(rng, lens, block_size, width)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    pages = [torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
             for _ in range(2)]
    queries = int(rng.choice([1, 1, 3, 5]))
    q = (3 * torch.randn(batch * queries, kv_heads * group, head_dim, generator=gen)).to(dtype)
    soft_cap = float(rng.choice([5.0, 30.0])) if rng.random() < 0.5 else None
    window = int(rng.choice([8, 33, 64])) if rng.random() < 0.5 else None
    kwargs = {"scale": head_dim ** -0.5, "soft_cap": soft_cap, "sliding_window": window}
    label = (f"lens={lens.tolist()} queries={queries} kv={kv_heads}x{group} d={head_dim} bs={block_size} "
             f"cap={soft_cap} win={window} {dtype}")
    return OpCase((q, *pages, torch.from_numpy(lens.astype(np.int32)), tables), kwargs, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.paged_attention, fake=fake, generate=generate_case,
    # fp32: summation order of the online softmax. bf16: the output rounding (2**-8).
    tolerances={torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def shape_problem(q, k_pages, v_pages, context_lens, block_tables, **_):
    """Why our kernel's TPU constraints reject these tensors, or None when they fit."""
    from tpu_executor.kernels.paged_attention import kernel

    def fits_kernel():  # runs after the operand check, so the shapes below exist
        ppc = kernel.default_pages_per_chunk(k_pages.shape[2], block_tables.shape[1])
        queries = reference.queries_per_sequence(q, block_tables)
        kernel.validate(tuple(q.shape), tuple(k_pages.shape), torch_dtype_name(q), ppc, queries)

    return first_problem(lambda: check_attention_operands(OP_NAME, q, k_pages, v_pages), fits_kernel)


def shipped_kernel_problem(q, *args, sliding_window=None, **kwargs):
    """JAX's kernel has no sliding window, reads K/V as bf16 (so it takes bf16 only) and one
    query per sequence; otherwise the same layout limits as ours."""
    block_tables = args[3] if len(args) > 3 else kwargs.get("block_tables")
    if block_tables is not None and q.shape[0] != block_tables.shape[0]:
        return "jax's paged_attention takes one query per sequence"
    if sliding_window is not None:
        return "jax's paged_attention has no sliding window"
    if q.dtype != torch.bfloat16:
        return "jax's paged_attention rounds K/V to bf16: it only serves bf16 caches"
    return shape_problem(q, *args)


def _pallas_paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale,
                            soft_cap=None, sliding_window=None, interpret=False):
    from tpu_executor.kernels.paged_attention import kernel

    return kernel.paged_attention(q, k_pages, v_pages, context_lens, block_tables, scale=scale,
                                  soft_cap=soft_cap, sliding_window=sliding_window,
                                  interpret=interpret)


def _jax_paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale,
                         soft_cap=None, sliding_window=None, interpret=False):
    """JAX's shipped kernel adapted to our contract: q pre-scaled in fp32, table width padded
    to whole compute blocks. It reads K/V rounded to bf16 (fp32 caches lose precision)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_kernel

    from tpu_executor.kernels.paged_attention import kernel

    if sliding_window is not None:
        raise ValueError("jax's paged_attention has no sliding window")
    width = block_tables.shape[1]
    ppc = kernel.default_pages_per_chunk(k_pages.shape[2], width)
    tables = jnp.pad(block_tables, ((0, 0), (0, -(-width // ppc) * ppc - width))).astype(jnp.int32)
    scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)
    return jax_kernel(scaled, k_pages, v_pages, context_lens.astype(jnp.int32), tables,
                      attn_logits_soft_cap=soft_cap, pages_per_compute_block=ppc)


def pallas_op():
    """``torch.ops.tpu_executor.paged_attention_pallas``: our kernel through call_jax."""
    return jax_backed_op("paged_attention_pallas", SCHEMA, _pallas_paged_attention, fake)


def jax_shipped_op():
    """``torch.ops.tpu_executor.paged_attention_jax``: JAX's kernel through call_jax."""
    return jax_backed_op("paged_attention_jax", SCHEMA, _jax_paged_attention, fake)


def register(registry=REGISTRY) -> None:
    """Our Pallas kernel first (through torch_xla, or inline on the JAX path), JAX's shipped
    kernel next (all on TPU), then for untraced calls on a torch device (the native path) the
    C kernel on fp32 CPU tensors and the pages-in-use path for the rest, the reference last."""
    registry.register(OP_NAME, tpu_provider("pallas", 20, pallas_op, shape_problem,
                                            sources=(KERNEL_MODULE,)))
    registry.register(OP_NAME, jax_tpu_provider("pallas_jax", 20, _pallas_paged_attention, shape_problem,
                                                sources=(KERNEL_MODULE,), split=HEADS))
    # Below ours: it rounds K/V to bf16 and has no sliding window.
    registry.register(OP_NAME, tpu_provider(
        "jax_paged_attention", 10, jax_shipped_op, shipped_kernel_problem,
        sources=(KERNEL_MODULE, "jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel")))
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.paged_attention))
    registry.register(OP_NAME, Provider("eager_sdpa", eager.paged_attention, priority=5, supports_args=eager_only))
    registry.register(OP_NAME, Provider("reference", reference.paged_attention, priority=0,
                                        is_reference=True))


def paged_attention(q, k_pages, v_pages, context_lens, block_tables, *, scale, soft_cap=None,
                    sliding_window=None):
    """Decode attention over paged K/V; see ``reference.paged_attention`` for the contract."""
    return REGISTRY.dispatch(OP_NAME, q, k_pages, v_pages, context_lens, block_tables,
                             scale=scale, soft_cap=soft_cap, sliding_window=sliding_window)
