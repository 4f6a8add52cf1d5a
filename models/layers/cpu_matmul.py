"""CPU-only matmul forms, chosen once after loading on a CPU (never on a TPU).

Measured with ``tpu-executor bench throughput --profile`` (docs/design.md):
- native path (``pack_for_cpu``): fp32 weights packed once into the panels of the
  ``packed_matmul`` op, whose C kernel streams them with prefetching (decode-sized products
  1.2-1.5x faster than oneDNN's on a 2-core AVX-512 EPYC, prefill-sized ones level). Where
  that kernel cannot be built, into oneDNN's blocked layout instead: on a 2-core AVX2 EPYC,
  decode-sized matmuls (32 rows) ran up to 2x faster than MKL's ``x @ W``, prefill-sized ones
  within about 15% either way; inputs of 129-159 rows are split (``ONEDNN_SLOW_ROWS``, below).
- XLA on CPU (``use_xla_cpu_form``): XLA's CPU dot (Eigen) runs ``x @ W`` at about a third
  of its speed on prefill-sized inputs (128-512 rows) when neither the input nor the output
  features reach 3,072 (e.g. 33 vs 110 GFLOP/s for 768 -> 1,152 at 512 rows), while the
  ``[out, in]`` form ``F.linear`` does not fall into that hole; at decode sizes (32 rows), and
  with either side at 3,072 or more, ``x @ W`` is the faster form (up to 4x). So such small
  layers also keep the checkpoint's ``[out, in]`` copy there and use it for inputs of 128
  rows or more; at 32-64 rows over 1,536-2,048 input features they run as two half-width
  dots (a slow case of Eigen's, below). The row count is static in every compiled graph: no
  graph is added.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tpu_executor.kernels.packed_matmul import cpu_native as packed_matmul_cpu
from tpu_executor.kernels.packed_matmul.ops import packed_matmul
from tpu_executor.kernels.packed_matmul.reference import pack


def onednn_packed(weight: torch.Tensor) -> torch.Tensor:
    """An ``[in, out]`` weight reordered into oneDNN's blocked layout (an opaque CPU tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().t().contiguous())


# oneDNN runs packed fp32 matmuls of 129-159 rows far below its rate at 128 or 160 (768 ->
# 6,144 features: 4.3 ms at 130 rows, 2.7 ms at 128; measured on a 2-core AVX-512 EPYC): such
# inputs, as a 128-token prompt beside a few decodes, run as 128 rows and the rest.
ONEDNN_SLOW_ROWS = range(129, 160)
ONEDNN_SPLIT_AT = 128


def onednn_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ W`` for a weight packed by ``onednn_packed``."""
    if x.shape[0] in ONEDNN_SLOW_ROWS:
        return torch.cat([onednn_matmul(x[:ONEDNN_SPLIT_AT], packed), onednn_matmul(x[ONEDNN_SPLIT_AT:], packed)])
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def cpu_packed(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 CPU weight ``[in, out]`` in the native path's form: ``packed_matmul``'s panels
    where its C kernel builds here, else oneDNN's blocked layout (an opaque tensor)."""
    return pack(weight) if packed_matmul_cpu.supported() else onednn_packed(weight)


def cpu_packed_matmul(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W`` for a weight in the form ``cpu_packed`` gave (``out_features`` columns)."""
    if packed.is_mkldnn:
        return onednn_matmul(x, packed)
    rows = x.reshape(-1, x.shape[-1])
    return packed_matmul(rows, packed, out_features=out_features).reshape(*x.shape[:-1], out_features)


# Below this many input and output features, and from this many rows on, XLA's CPU dot
# prefers the [out, in] form (see above).
XLA_CPU_OUT_IN_BELOW = 3072
XLA_CPU_OUT_IN_MIN_ROWS = 128
# Eigen's dot (XLA's CPU backend) has a hole at 32-64 rows over 1,536-2,048 input features:
# 31-34 GFLOP/s (SmolLM2's down projection, 1,536 -> 576, at 32 rows), while two dots over
# half the features each, summed, ran at 56-98. Fewer or more rows, or other widths (1,024,
# 1,280, 2,560, 3,072 features), do not have it; measured on a 2-core AVX2 EPYC.
XLA_CPU_SPLIT_K_ROWS = range(32, 65)
XLA_CPU_SPLIT_K_FEATURES = range(1536, 2049)


def splits_features(rows: int, features: int) -> bool:
    """Whether a small layer's matmul over ``features`` inputs at ``rows`` rows runs as two
    half-width dots on XLA's CPU backend (Eigen's slow case above)."""
    return rows in XLA_CPU_SPLIT_K_ROWS and features in XLA_CPU_SPLIT_K_FEATURES


def xla_cpu_small_matmul(x: torch.Tensor, weight: torch.Tensor, weight_out_in: torch.Tensor) -> torch.Tensor:
    """``x @ W`` for a layer under ``XLA_CPU_OUT_IN_BELOW`` features a side on XLA's CPU
    backend, in the form measured fastest for its row count (static in a compiled graph)."""
    rows, features = x.shape[0], weight.shape[0]
    if rows >= XLA_CPU_OUT_IN_MIN_ROWS:
        return F.linear(x, weight_out_in)
    if splits_features(rows, features):
        half = features // 2
        return x[:, :half] @ weight[:half] + x[:, half:] @ weight[half:]
    return x @ weight


def packable_for_cpu(weight: Optional[torch.Tensor]) -> bool:
    """oneDNN packing was measured for fp32 CPU weights only."""
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32 \
        and torch.backends.mkldnn.is_available()
