"""``rotary_embedding`` for the native CPU path, fp32: a small C kernel (``cpu_rotary.c``).

torch runs RoPE as five small ops over q and k; at decode sizes their dispatch costs more than
their arithmetic. The kernel reads x in place (q's and k's heads as a view of the QKV
projection's output) and writes the rotated heads once, bit-identical to the reference.
"""
from __future__ import annotations

import ctypes
import os

import torch

from tpu_executor.kernels import cpu_library

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_rotary.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 3 + (ctypes.c_int64,) * 3 + (ctypes.c_int,)

KERNEL = cpu_library.CFunction(SOURCE, "rotary_f32", _ARGTYPES)
supported = KERNEL.supported


def supports_args(x=None, cos=None, sin=None, *args, **kwargs) -> bool:
    """fp32 CPU tensors, untraced: x ``[T, heads, d]`` with an even d and each token's heads
    contiguous, cos and sin ``[T, 1, d]``."""
    if not (cpu_library.untraced_fp32_cpu(x, cos, sin) and cpu_library.heads_contiguous(x)):
        return False
    tokens, heads, d = x.shape
    angles = (tokens, 1, d)
    return d % 2 == 0 and cos.shape == angles and sin.shape == angles


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as ``reference.rotary_embedding`` (fp32 CPU tensors)."""
    tokens, heads, d = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = x.new_empty(tokens, heads, d)
    KERNEL(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens, heads, d,
             torch.get_num_threads())
    return out
