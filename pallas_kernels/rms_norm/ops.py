"""The ``rms_norm`` op (RMSNorm, optionally after the residual add): its spec and providers."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.binding import eager_only
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.rms_norm import cpu_native, reference
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance

OP_NAME = "rms_norm"


def fake(x, weight, *, eps, unit_offset=False, residual=None):
    """Output shapes and dtypes."""
    return torch.empty_like(x) if residual is None else (torch.empty_like(x), torch.empty_like(x))


def generate_case(rng: np.random.Generator) -> OpCase:
    """Rows of widths with and without a remainder past sixteen, both weight conventions,
    with and without a residual, values of a few magnitudes."""
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    rows, width = int(rng.integers(1, 70)), int(rng.choice([8, 64, 96, 200, 576, 768]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    x = (float(rng.choice([0.01, 1.0, 30.0])) * torch.randn(rows, width, generator=gen)).to(dtype)
    unit_offset = bool(rng.random() < 0.5)
    weight = (0.5 * torch.randn(width, generator=gen) + (0.0 if unit_offset else 1.0)).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype) if rng.random() < 0.5 else None
    kwargs = {"eps": float(rng.choice([1e-6, 1e-5])), "unit_offset": unit_offset, "residual": residual}
    label = f"rows={rows} width={width} unit_offset={unit_offset} residual={residual is not None} {dtype}"
    return OpCase((x, weight), kwargs, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.rms_norm, fake=fake, generate=generate_case,
    # fp32: the mean square summed in another order (a few ulp of the scale). bf16: the
    # output rounding.
    tolerances={torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def fused_rms_norm(x, weight, *, eps, unit_offset=False, residual=None):
    """The reference's steps through torch's one ``rms_norm`` call (fp32: bit-identical)."""
    if residual is not None:
        summed = x + residual
        return fused_rms_norm(summed, weight, eps=eps, unit_offset=unit_offset), summed
    return F.rms_norm(x, (x.shape[-1],), 1.0 + weight if unit_offset else weight, eps)


def fp32_untraced(x=None, *args, **kwargs) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype == torch.float32 and eager_only(x)


def register(registry=REGISTRY) -> None:
    """The C kernel for untraced fp32 CPU calls (the native path), torch's fused ``rms_norm``
    for other untraced fp32 calls (a GPU), the reference everywhere else (a traced graph fuses
    the steps itself)."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.rms_norm))
    registry.register(OP_NAME, Provider("eager_fused", fused_rms_norm, priority=5, supports_args=fp32_untraced))
    registry.register(OP_NAME, Provider("reference", reference.rms_norm, priority=0, is_reference=True))


def rms_norm(x, weight, *, eps: float, unit_offset: bool = False, residual=None):
    """RMSNorm of x (or of ``x + residual``, returned with the sum); see ``reference.rms_norm``."""
    return REGISTRY.dispatch(OP_NAME, x, weight, eps=eps, unit_offset=unit_offset, residual=residual)
