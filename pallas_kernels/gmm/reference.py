"""THE reference for grouped matmul (MoE experts): the executable spec and the CPU path.

Shapes:
  lhs          [m, k]            rows sorted by group: group 0's rows first, then group 1's, ...
  rhs          [groups, k, n]    ([groups, n, k] with transpose_rhs=True)
  group_sizes  [groups] int      rows per group; their sum may be less than m
  rhs_scale    [groups, n] fp32  or None: ``rhs`` is int8 and group g's matrix is ``rhs[g] *
                                 rhs_scale[g]`` (INT8 experts, one scale per output channel);
               [groups, k / group, n]: ``rhs`` is packed INT4 ``[groups, k / 2, n]``
                                 (``w4a16_matmul``'s layout) with group scales
  rhs_zero     [groups, k / group, n] fp32 or None: INT4's zero points
Returns [m, n] in lhs's dtype: row r of group g is lhs[r] @ rhs[g]. Rows past
sum(group_sizes) (and rows a group would place past m) are zero. Accumulates in fp32.
"""
from __future__ import annotations

from typing import Optional

import torch

from tpu_executor.kernels.w4a16_matmul.reference import dequantize as dequantize_int4


def row_groups(group_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """Group index of each of m rows; rows past the last group get ``len(group_sizes)``.

    Counted as "group ends at or before the row" with a compare and a sum: torch_xla has no
    lowering for ``searchsorted``, which would fall back to the CPU and split the graph.
    """
    ends = torch.cumsum(group_sizes.to(torch.int64), 0)
    rows = torch.arange(m, device=group_sizes.device)
    return (ends[None, :] <= rows[:, None]).sum(dim=1)


def expert_weights(k: int, rhs: torch.Tensor, rhs_scale: Optional[torch.Tensor], rhs_zero: Optional[torch.Tensor],
                   transpose_rhs: bool = False) -> torch.Tensor:
    """The experts' real matrices ``[groups, k, n]`` in fp32: ``rhs`` itself, INT8 levels times
    their per-channel scales, or INT4 bytes unpacked, shifted by their zeros and scaled."""
    if rhs_scale is not None and not transpose_rhs and rhs.shape[1] * 2 == k:
        return dequantize_int4(rhs, rhs_scale, rhs_zero, torch.float32)
    weights = rhs.float().transpose(1, 2) if transpose_rhs else rhs.float()
    return weights if rhs_scale is None else weights * rhs_scale.float()[:, None, :]


def gmm(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, rhs_scale: Optional[torch.Tensor] = None,
        rhs_zero: Optional[torch.Tensor] = None, *, transpose_rhs: bool = False,
        tp_split: Optional[str] = None) -> torch.Tensor:
    """Each row times its group's matrix, as one masked batched matmul over groups.
    ``tp_split`` (how a mesh splits ``rhs``) changes nothing here: XLA partitions this.

    Fixed shapes only (no data-dependent slicing), so it compiles once per shape under XLA;
    it does ``groups`` times the work of a real grouped matmul, which is why it is the
    reference and the CPU path, not the TPU path.
    """
    groups = rhs.shape[0]
    weights = expert_weights(lhs.shape[1], rhs, rhs_scale, rhs_zero, transpose_rhs)
    owner = row_groups(group_sizes, lhs.shape[0])
    mask = owner[None, :] == torch.arange(groups, device=lhs.device)[:, None]  # [groups, m]
    masked = lhs.float()[None] * mask[:, :, None]
    return torch.bmm(masked, weights).sum(0).to(lhs.dtype)
