"""``rms_norm`` for the native CPU path, fp32: a small C kernel (``cpu_rms_norm.c``).

torch runs an RMSNorm as about six small ops and the residual add before it as another; at
decode sizes each costs more in dispatch than in arithmetic. Measured on a 2-core AVX-512 EPYC
inside the engine's decode step (32 rows of 576-768 features): 50-60 us per norm through
torch, a few us here.
"""
from __future__ import annotations

import ctypes
import os

import torch

from tpu_executor.kernels import cpu_library

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_rms_norm.c")
_ARGTYPES = (ctypes.c_void_p,) * 5 + (ctypes.c_int64,) * 2 + (ctypes.c_float, ctypes.c_int, ctypes.c_int)

KERNEL = cpu_library.CFunction(SOURCE, "rms_norm_f32", _ARGTYPES)
supported = KERNEL.supported


def supports_args(x=None, weight=None, *args, residual=None, **kwargs) -> bool:
    """fp32 CPU tensors, untraced; a weight as wide as x's rows, a residual of x's shape."""
    if residual is not None and not (cpu_library.untraced_fp32_cpu(residual) and residual.shape == x.shape):
        return False
    return cpu_library.untraced_fp32_cpu(x, weight) and x.dim() >= 1 and weight.shape == x.shape[-1:]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, *, eps: float, unit_offset: bool = False, residual=None):
    """Same contract as ``reference.rms_norm`` (fp32 CPU tensors)."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        _norm(x, None, None, weight, out, eps, unit_offset)
        return out
    summed = torch.empty_like(x)
    _norm(x, residual.contiguous(), summed, weight, out, eps, unit_offset)
    return out, summed


def _norm(x, residual, summed, weight, out, eps: float, unit_offset: bool) -> None:
    """The kernel over contiguous tensors (residual and summed both None, or both set)."""
    pointers = (None, None) if residual is None else (residual.data_ptr(), summed.data_ptr())
    KERNEL(x.data_ptr(), *pointers, weight.data_ptr(), out.data_ptr(), x.shape[:-1].numel(), x.shape[-1], eps,
           int(unit_offset), torch.get_num_threads())
