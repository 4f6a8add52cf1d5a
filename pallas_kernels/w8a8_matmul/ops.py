"""The ``w8a8_matmul`` op: INT8 weights times INT8 activations quantized per token (W8A8). Its
spec and providers: the Pallas kernel on a TPU (``kernel.py``, both paths), ``torch._int_mm``
on the native CPU path (oneDNN's INT8 GEMM, VNNI's dot products where the CPU has them), the
reference elsewhere."""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from tpu_executor.kernels.binding import jax_backed_op, jax_tpu_provider, tpu_provider
from tpu_executor.kernels.cpu_library import untraced_fp32_cpu
from tpu_executor.kernels.mesh_split import TOKEN_QUANTIZED_LINEAR_WEIGHTS
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.w8a8_matmul import reference
from tpu_executor.kernels.w8a16_matmul.reference import quantize_per_channel

OP_NAME = "w8a8_matmul"
KERNEL_MODULE = "tpu_executor.kernels.w8a8_matmul.kernel"
SCHEMA = "(Tensor x, Tensor weight, Tensor scale, *, str? tp_split=None, bool interpret=False) -> Tensor"


def shape_problem(x, weight, scale, *, tp_split=None) -> Optional[str]:
    """Why the Pallas kernel cannot take this call (None: it can)."""
    from tpu_executor.kernels.w8a16_matmul.kernel import problem

    if x.dim() != 2 or weight.dim() != 2 or scale.dim() != 1:
        return "the kernel takes x [m, k], an int8 weight [k, n] and per-channel scales [n]"
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != torch.int8 or scale.dtype != torch.float32:
        return (f"the kernel takes fp32/bf16 x, int8 weights and fp32 scales, got {x.dtype}, {weight.dtype}, "
                f"{scale.dtype}")
    return problem(x.shape[0], weight.shape[0], weight.shape[1], weight.shape[0], 1)


def fake(x, weight, scale, *, tp_split=None):
    """Output shape and dtype."""
    return x.new_empty(x.shape[0], weight.shape[1])


def int_mm_fits(x=None, weight=None, scale=None, *, tp_split=None) -> bool:
    """fp32 CPU tensors outside a trace, an int8 CPU weight ``[k, n]``."""
    return untraced_fp32_cpu(x, scale) and isinstance(weight, torch.Tensor) and weight.dtype == torch.int8 \
        and weight.device.type == "cpu" and x.dim() == 2 and weight.dim() == 2


def int_mm_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *, tp_split=None) -> torch.Tensor:
    """The reference's arithmetic with the int32 sums from ``torch._int_mm``."""
    x_q, x_scale = reference.quantize_per_token(x)
    return torch._int_mm(x_q, weight) * x_scale[:, None] * scale[None, :]


def generate_case(rng: np.random.Generator) -> OpCase:
    """Random activations (some rows much larger than others) and a weight quantized per channel."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    t, k, n = int(rng.choice([1, 8, 37])), int(rng.choice([128, 256])), int(rng.choice([128, 384]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    weight, scale = quantize_per_channel(torch.randn(k, n, generator=gen) / k ** 0.5)
    x = (torch.randn(t, k, generator=gen) * torch.rand(t, 1, generator=gen) * 4).to(dtype)
    return OpCase((x, weight, scale), {}, f"t={t} k={k} n={n} {dtype}")


SPEC = OpSpec(
    name=OP_NAME, reference=reference.w8a8_matmul, fake=fake, generate=generate_case,
    # The int32 sums are exact on every provider; what differs is fp32 rounding of the scales'
    # products, a half-level flip of x's rounding where x / x_scale lands on .5 in another
    # order of operations, and bf16's output rounding.
    tolerances={torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
                torch.bfloat16: Tolerance(atol=3e-2, rtol=3e-2)})


def kernel_matmul(x, weight, scale, *, tp_split=None, interpret: bool = False):
    """The kernel (JAX arrays)."""
    from tpu_executor.kernels.w8a8_matmul.kernel import w8a8_matmul as kernel

    return kernel(x, weight, scale, interpret=interpret)


@functools.lru_cache(maxsize=None)
def torch_op():
    """The kernel as a torch op bound through torch_xla's call_jax (built once)."""
    return jax_backed_op(f"{OP_NAME}_pallas", SCHEMA, kernel_matmul, fake)


def register(registry=REGISTRY) -> None:
    registry.register(OP_NAME, Provider("cpu_int_mm", int_mm_matmul, priority=6, supports_args=int_mm_fits))
    registry.register(OP_NAME, tpu_provider("pallas", 20, torch_op, shape_problem, sources=(KERNEL_MODULE,)))
    registry.register(OP_NAME, jax_tpu_provider("pallas_jax", 20, kernel_matmul, shape_problem,
                                                sources=(KERNEL_MODULE,), split=TOKEN_QUANTIZED_LINEAR_WEIGHTS))
    registry.register(OP_NAME, Provider("reference", reference.w8a8_matmul, priority=0, is_reference=True))


def w8a8_matmul(x, weight, scale, tp_split=None):
    """``x`` quantized per token, times ``weight * scale``; see ``reference.w8a8_matmul``.
    ``tp_split``: how a mesh splits the weight, as ``w8a16_matmul``'s."""
    return REGISTRY.dispatch(OP_NAME, x, weight, scale, tp_split=tp_split)
