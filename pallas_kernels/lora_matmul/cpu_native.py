"""``lora_matmul`` for the native CPU path, fp32: a C kernel (``cpu_lora.c``).

The grouped torch form runs about twenty small ops per projection for a step of four adapters,
and a decode step calls the op for every projection of every layer: at decode sizes dispatch,
not arithmetic, was most of its cost. This is one call, its products blocked in registers.
"""
from __future__ import annotations

import ctypes
import os

import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.lora_matmul.forms import covers
from tpu_executor.kernels.lora_matmul.reference import Slices, blocks

SOURCE = os.path.join(os.path.dirname(__file__), "cpu_lora.c")
_ARGTYPES = (ctypes.c_void_p, ctypes.c_int64) + (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 5 \
    + (ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int)

KERNEL = cpu_library.CFunction(SOURCE, "lora_matmul_f32", _ARGTYPES, ctypes.c_int)
supported = KERNEL.supported


def supports_args(x=None, lora_a=None, lora_b=None, slots=None, *args, **kwargs) -> bool:
    """fp32 CPU tensors, untraced: x [T, in] with unit feature stride, contiguous slots of A
    and B, int64 CPU slot indices."""
    return cpu_library.untraced_fp32_cpu(x, lora_a, lora_b) and x.dim() == 2 and x.stride(1) == 1 \
        and lora_a.is_contiguous() and lora_b.is_contiguous() and lora_a.shape[1] == x.shape[1] \
        and isinstance(slots, torch.Tensor) and slots.dtype == torch.int64 and slots.device.type == "cpu" \
        and slots.shape == x.shape[:1]


def lora_matmul(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                out_slices: Slices = None) -> torch.Tensor:
    """Same contract as ``reference.lora_matmul`` (fp32 CPU tensors)."""
    tokens, (num_slots, in_features, rank), out_features = x.shape[0], lora_a.shape, lora_b.shape[2]
    features = [f for _, f in blocks(rank, out_features, out_slices)]
    out = x.new_empty(tokens, out_features) if covers(out_features, features) else x.new_zeros(tokens, out_features)
    if tokens:
        slots = slots.contiguous()
        projections = torch.tensor([[f.start, f.stop - f.start] for f in features], dtype=torch.int64)
        scratch = torch.empty(2 * tokens + 2 * num_slots + 1, dtype=torch.int64)
        failed = KERNEL(x.data_ptr(), x.stride(0), lora_a.data_ptr(), lora_b.data_ptr(), slots.data_ptr(),
                        out.data_ptr(), tokens, num_slots, in_features, rank, out_features, projections.data_ptr(),
                        len(features), scratch.data_ptr(), torch.get_num_threads())
        if failed:
            raise IndexError(f"lora_matmul: a slot index is outside the {num_slots} slots")
    return out
