"""``w8a16_matmul`` and ``w4a16_matmul`` for the native CPU path, fp32 activations: a C kernel
(``cpu_quant.c``) that reads the quantized weight in place, its bytes widened in registers.

The references dequantize the whole weight on every call (a copy four or eight times the
weight's bytes before the matmul starts); at decode sizes the matmul reads the weights from
memory, so reading a quarter (INT8) or an eighth (INT4) of the fp32 bytes is the saving.
"""
from __future__ import annotations

import ctypes
import os
import types
from typing import Optional

import torch

from tpu_executor.kernels import cpu_library

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_quant.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 4 \
    + (ctypes.c_int, ctypes.c_int)

KERNEL = cpu_library.CFunction(SOURCE, "quantized_matmul_f32", _ARGTYPES)


def _fits(bits: int, x=None, weight=None, scale=None, zero=None, *, tp_split=None) -> bool:
    """fp32 x [m, k] with unit feature stride, a contiguous int8 weight of k (INT4: k / 2)
    stored rows, fp32 scales per channel [n] or in groups [k / group, n] (zeros likewise)."""
    if not (cpu_library.untraced_fp32_cpu(x, scale) and isinstance(weight, torch.Tensor)
            and weight.dtype == torch.int8 and weight.device.type == "cpu" and weight.dim() == 2 and x.dim() == 2):
        return False
    k, (k_rows, n) = x.shape[1], weight.shape
    groups = 1 if scale.dim() == 1 else scale.shape[0]
    shapes_fit = k_rows * (2 if bits == 4 else 1) == k and scale.shape[-1] == n and k % groups == 0 \
        and (bits == 8 or (k // 2) % (k // groups) == 0)
    zero_fits = zero is None or (cpu_library.untraced_fp32_cpu(zero) and zero.shape == scale.shape)
    return shapes_fit and zero_fits and x.stride(1) == 1 and weight.is_contiguous()


def _matmul(bits: int, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
            zero: Optional[torch.Tensor] = None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[1]
    groups = 1 if scale.dim() == 1 else scale.shape[0]
    out = x.new_empty(m, n)
    if m:
        scale = scale.contiguous()
        zero_ptr = None if zero is None else zero.contiguous().data_ptr()
        KERNEL(x.data_ptr(), x.stride(0), weight.data_ptr(), scale.data_ptr(), zero_ptr, out.data_ptr(), m, k, n,
               k // groups, bits, torch.get_num_threads())
    return out


def int8_matmul(x, weight, scale, *, tp_split=None):
    """Same contract as ``w8a16_matmul/reference.w8a16_matmul`` (fp32 CPU tensors)."""
    return _matmul(8, x, weight, scale)


def int4_matmul(x, packed, scale, zero=None, *, tp_split=None):
    """Same contract as ``w4a16_matmul/reference.w4a16_matmul`` (fp32 CPU tensors)."""
    return _matmul(4, x, packed, scale, zero)


# The registry's view of each form (``cpu_library.c_provider``'s ``native``).
INT8 = types.SimpleNamespace(supported=KERNEL.supported, supports_args=lambda *a, **kw: _fits(8, *a, **kw))
INT4 = types.SimpleNamespace(supported=KERNEL.supported, supports_args=lambda *a, **kw: _fits(4, *a, **kw))
