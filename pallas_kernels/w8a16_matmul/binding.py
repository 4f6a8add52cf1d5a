"""The weight-only kernel (``kernel.py``) as providers of ``w8a16_matmul`` and ``w4a16_matmul``:
its shape checks, the JAX-side adapters both paths call, and the torch ops torch_xla binds.

A call's operands never include None: ``w4a16_matmul`` passes ``zero`` only when it has one,
and torch_xla binds the two forms as two ops."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from tpu_executor.kernels.binding import jax_backed_op, jax_tpu_provider, tpu_provider
from tpu_executor.kernels.mesh_split import LINEAR_WEIGHTS

KERNEL_MODULE = "tpu_executor.kernels.w8a16_matmul.kernel"
SCHEMAS = {3: "(Tensor x, Tensor weight, Tensor scale, *, str? tp_split=None, bool interpret=False) -> Tensor",
           4: "(Tensor x, Tensor weight, Tensor scale, Tensor zero, *, str? tp_split=None, bool interpret=False) "
              "-> Tensor"}


def shape_problem(bits: int, x, weight, scale, zero=None, *, tp_split=None) -> Optional[str]:
    """Why the kernel cannot take this call (None: it can)."""
    from tpu_executor.kernels.w8a16_matmul.kernel import problem

    if x.dim() != 2 or weight.dim() != 2 or scale.dim() not in (1, 2) or (zero is not None and zero.dim() != 2):
        return "the kernel takes x [m, k], a 2-D weight and 1-D or 2-D scales"
    if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != torch.int8 or scale.dtype != torch.float32:
        return (f"the kernel takes fp32/bf16 x, int8 weights and fp32 scales, got {x.dtype}, {weight.dtype}, "
                f"{scale.dtype}")
    k = x.shape[1]
    if weight.shape[0] * (2 if bits == 4 else 1) != k:
        return f"x has {k} input features, the INT{bits} weight {list(weight.shape)}"
    group = k if scale.dim() == 1 else k // scale.shape[0]
    return problem(x.shape[0], weight.shape[0], weight.shape[1], group, x.element_size())


def int8_matmul(x, weight, scale, *, tp_split=None, interpret: bool = False):
    """The kernel, INT8 (JAX arrays)."""
    from tpu_executor.kernels.w8a16_matmul.kernel import quantized_matmul

    return quantized_matmul(x, weight, scale, bits=8, interpret=interpret)


def int4_matmul(x, packed, scale, zero=None, *, tp_split=None, interpret: bool = False):
    """The kernel, INT4 (JAX arrays)."""
    from tpu_executor.kernels.w8a16_matmul.kernel import quantized_matmul

    return quantized_matmul(x, packed, scale, zero, bits=4, interpret=interpret)


@functools.lru_cache(maxsize=None)
def torch_op(op_name: str, bits: int, fake):
    """The kernel as torch ops bound through torch_xla's call_jax (``interpret=True`` runs it
    in TPU interpret mode): called with or without ``zero``, it picks the op of that form.
    Built once per op (the provider asks for it on every call)."""
    jax_fn = int8_matmul if bits == 8 else int4_matmul
    ops = {count: jax_backed_op(f"{op_name}_pallas{'_zero' if count == 4 else ''}", schema, jax_fn, fake)
           for count, schema in SCHEMAS.items() if bits == 4 or count == 3}
    return lambda *args, **kwargs: ops[len(args)](*args, **kwargs)


def register(registry, op_name: str, bits: int, fake, reference) -> None:
    """Both weight-only ops' providers: the Pallas kernel on a TPU (torch_xla's binding, the
    JAX path's inline call), the native path's C kernel (``cpu_native.py``), the reference."""
    from tpu_executor.kernels import cpu_library
    from tpu_executor.kernels.registry import Provider
    from tpu_executor.kernels.w8a16_matmul import cpu_native

    def problem(*args, **kwargs):
        return shape_problem(bits, *args, **kwargs)

    native = (cpu_native.INT8, cpu_native.int8_matmul) if bits == 8 else (cpu_native.INT4, cpu_native.int4_matmul)
    registry.register(op_name, cpu_library.c_provider(*native))
    registry.register(op_name, tpu_provider("pallas", 20, functools.partial(torch_op, op_name, bits, fake), problem,
                                            sources=(KERNEL_MODULE, __name__)))
    registry.register(op_name, jax_tpu_provider("pallas_jax", 20, int8_matmul if bits == 8 else int4_matmul, problem,
                                                sources=(KERNEL_MODULE,), split=LINEAR_WEIGHTS))
    registry.register(op_name, Provider("reference", reference, priority=0, is_reference=True))
