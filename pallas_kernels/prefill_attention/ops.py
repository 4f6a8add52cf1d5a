"""The ``prefill_attention`` op: its spec (reference, fake, tolerances, cases) and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.binding import eager_only, first_problem, jax_backed_op, jax_tpu_provider, tpu_provider
from tpu_executor.kernels.mesh_split import HEADS
from tpu_executor.kernels.paged_attention.ops import random_block_tables
from tpu_executor.kernels.prefill_attention import cpu_native, eager, reference
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.tpu_layout import check_attention_operands, torch_dtype_name

OP_NAME = "prefill_attention"
KERNEL_MODULE = "tpu_executor.kernels.prefill_attention.kernel"
SCHEMA = ("(Tensor q, Tensor k_pages, Tensor v_pages, Tensor context_slots, Tensor key_positions, "
          "Tensor key_segments, Tensor query_positions, Tensor query_segments, *, float scale, "
          "float? soft_cap=None, int? sliding_window=None, bool interpret=False) -> Tensor")


def fake(q, *args, **kwargs):
    """Output shape and dtype, for tracing providers that are opaque custom calls."""
    return torch.empty_like(q)


def packed_layout(rng: np.random.Generator, block_size: int, long_context: bool = False):
    """Up to three prompts, some with prefix-cached blocks, packed like the model runner
    packs them: each context's keys padded to whole pages, padding queries and keys in segment
    -1. ``long_context``: the first is a later chunk of a long prompt (1,000-2,600 tokens of
    context before its 64-200 new ones). Returns int64 tensors and the number of pages used."""
    seqs = int(rng.integers(1, 4))
    cached = [block_size * int(rng.integers(0, 3)) if rng.random() < 0.5 else 0 for _ in range(seqs)]
    new = [int(rng.integers(1, 81)) for _ in range(seqs)]
    if long_context:
        cached[0], new[0] = int(rng.integers(1000, 2600)), int(rng.integers(64, 201))
    tables, num_blocks = random_block_tables(rng, [c + n for c, n in zip(cached, new)], block_size,
                                             width=-(-(max(cached) + max(new)) // block_size))
    q_pos, q_seg, k_pos, k_seg, slots = [], [], [], [], []
    for s, (c, n) in enumerate(zip(cached, new)):
        positions = np.arange(-(-(c + n) // block_size) * block_size)  # to the end of the last page
        q_pos += list(positions[c:c + n])
        q_seg += [s] * n
        k_pos += list(np.where(positions < c + n, positions, 0))
        k_seg += [s if p < c + n else -1 for p in positions]
        slots += list(tables[s, positions // block_size].numpy() * block_size + positions % block_size)
    pad = int(rng.integers(0, 24))  # bucket padding: queries and one key in segment -1
    q_pos += [0] * pad
    q_seg += [-1] * pad
    if pad:
        k_pos.append(0)
        k_seg.append(-1)
        slots.append(0)
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    layout = tuple(as_long(x) for x in (slots, k_pos, k_seg, q_pos, q_seg))
    return layout, num_blocks, f"cached={cached} new={new} pad={pad}"


def generate_case(rng: np.random.Generator, long_context: bool = False) -> OpCase:
    """Packed prompts, prefix-cached context, GQA, soft-cap and window on and off;
    ``long_context``: a chunk of a long prompt among them (see ``packed_layout``)."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    kv_heads, group = int(rng.choice([1, 2])), int(rng.choice([1, 2, 4]))
    head_dim, block_size = 128, int(rng.choice([16, 32]))
    layout, num_blocks, shape_label = packed_layout(rng, block_size, long_context)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    pages = [torch.randn(kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
             for _ in range(2)]
    q = (3 * torch.randn(layout[3].shape[0], kv_heads * group, head_dim, generator=gen)).to(dtype)
    soft_cap = float(rng.choice([5.0, 30.0])) if rng.random() < 0.5 else None
    window = int(rng.choice([8, 33, 64])) if rng.random() < 0.5 else None
    kwargs = {"scale": head_dim ** -0.5, "soft_cap": soft_cap, "sliding_window": window}
    label = f"{shape_label} kv={kv_heads}x{group} bs={block_size} cap={soft_cap} win={window} {dtype}"
    return OpCase((q, *pages, *layout), kwargs, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.prefill_attention, fake=fake, generate=generate_case,
    # fp32: summation order of the online softmax. bf16: the output rounding (2**-8).
    tolerances={torch.float32: Tolerance(atol=2e-5, rtol=2e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def shape_problem(q, k_pages, v_pages, context_slots, *args, **kwargs):
    """Why our kernel's TPU constraints reject these tensors, or None when they fit."""
    from tpu_executor.kernels.prefill_attention import kernel

    def fits_kernel():  # runs after the operand check, so the shapes below exist
        dtype_name = torch_dtype_name(q)
        blocks = kernel.choose_blocks(q.shape[0], context_slots.shape[0], dtype_name)
        kernel.validate(tuple(q.shape), tuple(k_pages.shape), dtype_name, *blocks)

    return first_problem(lambda: check_attention_operands(OP_NAME, q, k_pages, v_pages), fits_kernel)


def _pallas_prefill_attention(*args, scale, soft_cap=None, sliding_window=None, interpret=False):
    from tpu_executor.kernels.prefill_attention import kernel

    return kernel.prefill_attention(*args, scale=scale, soft_cap=soft_cap,
                                    sliding_window=sliding_window, interpret=interpret)


def pallas_op():
    """``torch.ops.tpu_executor.prefill_attention_pallas``: our kernel through call_jax."""
    return jax_backed_op("prefill_attention_pallas", SCHEMA, _pallas_prefill_attention, fake)


def register(registry=REGISTRY) -> None:
    """Our Pallas kernel (TPU: through torch_xla, or inline on the JAX path); for untraced
    calls on a torch device (the native path) the C kernel on fp32 CPU tensors, then attention
    prompt by prompt through torch's SDPA; the reference last. JAX ships no kernel with this
    contract (its flash attention knows neither pages, packed positions, soft-cap nor windows)."""
    registry.register(OP_NAME, tpu_provider("pallas", 20, pallas_op, shape_problem, sources=(KERNEL_MODULE,)))
    registry.register(OP_NAME, jax_tpu_provider("pallas_jax", 20, _pallas_prefill_attention, shape_problem,
                                                sources=(KERNEL_MODULE,), split=HEADS))
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.prefill_attention))
    registry.register(OP_NAME, Provider("eager_segments", eager.prefill_attention, priority=5,
                                        supports_args=eager_only))
    registry.register(OP_NAME, Provider("reference", reference.prefill_attention, priority=0,
                                        is_reference=True))


def prefill_attention(q, k_pages, v_pages, context_slots, key_positions, key_segments,
                      query_positions, query_segments, *, scale, soft_cap=None, sliding_window=None):
    """Packed, segment-causal prefill attention over paged context; see the reference."""
    return REGISTRY.dispatch(OP_NAME, q, k_pages, v_pages, context_slots, key_positions,
                             key_segments, query_positions, query_segments, scale=scale,
                             soft_cap=soft_cap, sliding_window=sliding_window)
