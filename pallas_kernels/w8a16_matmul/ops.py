"""The ``w8a16_matmul`` op: weight-only INT8 matmul. Its spec and its providers: the Pallas
kernel on a TPU (``kernel.py``, both paths), the reference (dequantize, then matmul) elsewhere."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels.registry import REGISTRY
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.w8a16_matmul import binding, reference

OP_NAME = "w8a16_matmul"
KERNEL_MODULE = binding.KERNEL_MODULE


def shape_problem(*args, **kwargs):
    """Why the Pallas kernel cannot take this call (None: it can)."""
    return binding.shape_problem(8, *args, **kwargs)


def fake(x, weight, scale, *, tp_split=None):
    """Output shape and dtype."""
    return x.new_empty(x.shape[0], weight.shape[1])


def generate_case(rng: np.random.Generator) -> OpCase:
    """Random activations and a quantized random weight (per channel, or in groups)."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    t, k, n = int(rng.choice([1, 8, 37])), int(rng.choice([128, 256])), int(rng.choice([32, 40, 256]))
    group = int(rng.choice([0, 32, 128]))  # 0: per output channel
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    w = torch.randn(k, n, generator=gen) / k ** 0.5
    weight, scale = reference.quantize_groups(w, group) if group else reference.quantize_per_channel(w)
    x = torch.randn(t, k, generator=gen).to(dtype)
    return OpCase((x, weight, scale), {}, f"t={t} k={k} n={n} group={group or 'channel'} {dtype}")


SPEC = OpSpec(
    name=OP_NAME, reference=reference.w8a16_matmul, fake=fake, generate=generate_case,
    tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def register(registry=REGISTRY) -> None:
    binding.register(registry, OP_NAME, 8, fake, reference.w8a16_matmul)


def w8a16_matmul(x, weight, scale, tp_split=None):
    """``x @ (weight * scale)``; see ``reference.w8a16_matmul`` for the contract. ``tp_split``
    says how a mesh splits the weight (the JAX path's kernel runs per chip as it says)."""
    return REGISTRY.dispatch(OP_NAME, x, weight, scale, tp_split=tp_split)
