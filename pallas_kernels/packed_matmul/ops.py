"""The ``packed_matmul`` op (``x @ W``, W packed into panels): its spec and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.packed_matmul import cpu_native, reference
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance

OP_NAME = "packed_matmul"


def fake(x, panels, *, out_features):
    """Output shape and dtype."""
    return x.new_empty(x.shape[0], out_features)


def generate_case(rng: np.random.Generator) -> OpCase:
    """Row counts around the kernel's tiles (8 rows), output widths around its panels (16
    features, 3 a group), and x a view with a wider row stride now and then."""
    dtype = torch.bfloat16 if rng.random() < 0.2 else torch.float32
    rows = int(rng.choice([1, 3, 7, 8, 9, 17, 32, 33, 130]))
    in_features = int(rng.choice([1, 16, 64, 100, 576]))
    out_features = int(rng.choice([1, 15, 16, 17, 48, 50, 96, 200]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    wide = torch.randn(rows, in_features + int(rng.choice([0, 0, 5])), generator=gen).to(dtype)
    weight = torch.randn(in_features, out_features, generator=gen).to(dtype)
    return OpCase((wide[:, :in_features], reference.pack(weight)), {"out_features": out_features},
                  f"rows={rows} in={in_features} out={out_features} stride={wide.shape[1]} {dtype}")


SPEC = OpSpec(
    name=OP_NAME, reference=reference.packed_matmul, fake=fake, generate=generate_case,
    # fp32: another summation order over up to 576 products of unit normals (|x . w| ~ 24).
    tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def register(registry=REGISTRY) -> None:
    """The C kernel for untraced fp32 CPU calls (the native path), the reference elsewhere."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.packed_matmul))
    registry.register(OP_NAME, Provider("reference", reference.packed_matmul, priority=0, is_reference=True))


def packed_matmul(x, panels, *, out_features: int):
    """``x @ W`` for W packed by ``reference.pack``; see ``reference.packed_matmul``."""
    return REGISTRY.dispatch(OP_NAME, x, panels, out_features=out_features)
