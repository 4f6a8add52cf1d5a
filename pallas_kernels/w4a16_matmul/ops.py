"""The ``w4a16_matmul`` op: weight-only INT4 matmul, group-wise scales (and zero points). Its
spec and its providers: the Pallas kernel on a TPU (``w8a16_matmul/kernel.py``, both paths),
the reference (unpack, dequantize, then matmul) elsewhere."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels.registry import REGISTRY
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.w4a16_matmul import reference
from tpu_executor.kernels.w8a16_matmul import binding

OP_NAME = "w4a16_matmul"
KERNEL_MODULE = binding.KERNEL_MODULE


def shape_problem(*args, **kwargs):
    """Why the Pallas kernel cannot take this call (None: it can)."""
    return binding.shape_problem(4, *args, **kwargs)


def fake(x, packed, scale, zero=None, *, tp_split=None):
    """Output shape and dtype."""
    return x.new_empty(x.shape[0], packed.shape[1])


def generate_case(rng: np.random.Generator) -> OpCase:
    """Random activations and a random weight quantized in groups of 32 to 128 input features,
    symmetric or with zero points."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    t, k, n = int(rng.choice([1, 8, 37])), int(rng.choice([256, 512])), int(rng.choice([128, 384]))
    group = int(rng.choice([32, 64, 128]))
    symmetric = bool(rng.random() < 0.5)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    packed, scale, zero = reference.quantize_int4(torch.randn(k, n, generator=gen) / k ** 0.5, group, symmetric)
    x = torch.randn(t, k, generator=gen).to(dtype)
    args = (x, packed, scale) + (() if zero is None else (zero,))  # as the op passes them on
    return OpCase(args, {}, f"t={t} k={k} n={n} group={group} symmetric={symmetric} {dtype}")


SPEC = OpSpec(
    name=OP_NAME, reference=reference.w4a16_matmul, fake=fake, generate=generate_case,
    # fp32: summation order over k <= 512 terms of size ~1. bf16: the weight rounded to bf16
    # after dequantizing (2**-8 relative) and the output's own rounding.
    tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
                torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2)})


def register(registry=REGISTRY) -> None:
    binding.register(registry, OP_NAME, 4, fake, reference.w4a16_matmul)


def w4a16_matmul(x, packed, scale, zero=None, tp_split=None):
    """``x @ ((unpack(packed) - zero) * scale)``; see ``reference.w4a16_matmul``. (``zero``
    is passed on only when there is one: kernels take tensors, not None.) ``tp_split``: as
    ``w8a16_matmul``'s."""
    return REGISTRY.dispatch(OP_NAME, x, packed, scale, *(() if zero is None else (zero,)), tp_split=tp_split)
