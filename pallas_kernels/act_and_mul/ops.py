"""The ``act_and_mul`` op (a gated MLP's ``act(gate) * up``): its spec and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.act_and_mul import cpu_native, reference
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance

OP_NAME = "act_and_mul"


def fake(x, *, activation):
    """Output shape and dtype."""
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def generate_case(rng: np.random.Generator) -> OpCase:
    """Rows of widths with and without a remainder past sixteen, values far into both tails."""
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    rows, width = int(rng.integers(1, 70)), int(rng.choice([16, 96, 200, 3072]))
    activation = str(rng.choice(sorted(reference.ACTIVATIONS)))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    x = (float(rng.choice([1.0, 3.0, 8.0])) * torch.randn(rows, 2 * width, generator=gen)).to(dtype)
    return OpCase((x,), {"activation": activation}, f"rows={rows} width={width} {activation} {dtype}")


SPEC = OpSpec(
    name=OP_NAME, reference=reference.act_and_mul, fake=fake, generate=generate_case,
    # fp32: a few ulp of e^x and of GELU's 1 + tanh (which cancels for negative gates: an ulp
    # of 1 times |gate * up|, up to 8 sigma here). bf16: the output rounding.
    tolerances={torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def register(registry=REGISTRY) -> None:
    """The C kernel for untraced fp32 CPU calls (the native path), the reference everywhere
    else (a traced graph fuses the two ops itself)."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.act_and_mul))
    registry.register(OP_NAME, Provider("reference", reference.act_and_mul, priority=0, is_reference=True))


def act_and_mul(x, *, activation: str):
    """``act(gate) * up`` of x's two halves; see ``reference.act_and_mul``."""
    return REGISTRY.dispatch(OP_NAME, x, activation=activation)
