"""``packed_matmul`` for the native CPU path, fp32: a C kernel (``cpu_gemm.c``).

The native path's linear layers spend most of a step here. oneDNN's packed matmul (the form
where this kernel cannot be built, and vLLM-CPU's) ran a decode-sized product at about 21 GB/s
of weights, waiting on memory; this kernel prefetches each thread's next panels while it
computes and needs no primitive built per new row count. Measured on a 2-core AVX-512 EPYC
(Zen 5), 32 rows, weights not in cache: 576 -> 3,072 features 349 -> 262 us, 1,536 -> 576
197 -> 147 us; at 512 rows within a few percent of oneDNN (``tpu-executor bench cpu-matmul``).
Without AVX-512 the tiles do not fit the registers (5-7x slower than oneDNN there), so
``supported`` is false and the layers keep oneDNN's form.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from tpu_executor.kernels import cpu_library

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_gemm.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int64,) * 3 \
    + (ctypes.c_int,)

KERNEL = cpu_library.CFunction(SOURCE, "packed_matmul_f32", _ARGTYPES)
_FITS_REGISTERS = cpu_library.CFunction(SOURCE, "packed_matmul_f32_fits_registers", (), ctypes.c_int)


@functools.lru_cache(maxsize=None)
def supported() -> bool:
    """The kernel builds here, with AVX-512 (its tiles need 28 vector registers)."""
    return cpu_library.built_with_wide_vectors(KERNEL, _FITS_REGISTERS, "packed_matmul", "oneDNN's packed matmul")


def supports_args(x=None, panels=None, *args, out_features=None, **kwargs) -> bool:
    """fp32 CPU tensors, untraced: x [T, K > 0] with unit feature stride, contiguous panels of K."""
    return cpu_library.untraced_fp32_cpu(x, panels) and x.dim() == 2 and panels.dim() == 3 \
        and panels.shape[1] == x.shape[1] > 0 and x.stride(1) == 1 and panels.is_contiguous() \
        and 0 < out_features <= panels.shape[0] * panels.shape[2]


def packed_matmul(x: torch.Tensor, panels: torch.Tensor, *, out_features: int) -> torch.Tensor:
    """Same contract as ``reference.packed_matmul`` (fp32 CPU tensors)."""
    rows, in_features = x.shape
    out = x.new_empty(rows, out_features)
    if rows:
        KERNEL(x.data_ptr(), x.stride(0), panels.data_ptr(), out.data_ptr(), rows, in_features, out_features,
               torch.get_num_threads())
    return out
