"""The ``rotary_embedding`` op (RoPE, "rotate half" layout): its spec and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.rotary_embedding import cpu_native, reference
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance

OP_NAME = "rotary_embedding"


def fake(x, cos, sin):
    """Output shape and dtype."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def generate_case(rng: np.random.Generator) -> OpCase:
    """Heads as a view of a wider row (q's and k's heads inside a QKV output) or contiguous,
    head sizes with and without a remainder past 32, positions up to a long context's."""
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    tokens, heads, d = int(rng.integers(1, 70)), int(rng.integers(1, 12)), int(rng.choice([8, 64, 96, 128, 200]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    extra = int(rng.choice([0, 3]))  # more heads in each row than rotated: a view
    x = torch.randn(tokens, heads + extra, d, generator=gen).to(dtype)[:, :heads]
    positions = torch.randint(0, 32768, (tokens,), generator=gen).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    label = f"tokens={tokens} heads={heads} d={d} view={extra > 0} {dtype}"
    return OpCase((x, angles.cos(), angles.sin()), {}, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.rotary_embedding, fake=fake, generate=generate_case,
    # fp32: the reference's products and sums in its order (bit-identical on the C kernel).
    # bf16: the output rounding.
    tolerances={torch.float32: Tolerance(atol=1e-6, rtol=1e-6),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def register(registry=REGISTRY) -> None:
    """The C kernel for untraced fp32 CPU calls (the native path), the reference everywhere
    else (a traced graph fuses the steps itself)."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.rotary_embedding))
    registry.register(OP_NAME, Provider("reference", reference.rotary_embedding, priority=0, is_reference=True))


def rotary_embedding(x, cos, sin):
    """x ``[T, heads, d]`` rotated by ``cos``/``sin`` ``[T, 1, d]``; see ``reference.rotary_embedding``."""
    return REGISTRY.dispatch(OP_NAME, x, cos, sin)
