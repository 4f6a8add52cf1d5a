"""How a Pallas kernel runs under SPMD on the JAX path: per chip, through ``shard_map``, over
its share of the operands.

A kernel is an opaque custom call that XLA's partitioner cannot split, so a mesh of several
chips either runs it per chip on operands split the way the model's weights and caches are
placed (``worker.jax.runtime.SPLIT_DIMS``), or falls back to the op's reference. Each split says
whether a call can be split over the chips, what one chip's operands look like (the kernel's
own shape checks run on them), and how to wrap the kernel: attention over its heads, grouped
matmul over the experts' split features, quantized linears over their split features.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch


def _local(tensor: torch.Tensor, dim: int, chips: int) -> torch.Tensor:
    """A meta tensor shaped like one chip's share of ``tensor`` split on ``dim``."""
    shape = list(tensor.shape)
    shape[dim] //= chips
    return torch.empty(shape, dtype=tensor.dtype, device="meta")


class OverHeads:
    """Attention: q ``[T, heads, d]`` first, then the K/V pages ``[kv_heads, ...]`` (the KV
    cache is split over its heads, or replicated when it has one: every chip's query heads then
    read that one), the metadata after them whole; the output split like q."""

    def problem(self, chips: int, args: Sequence, kwargs) -> Optional[str]:
        heads, kv_heads = args[0].shape[1], args[1].shape[0]
        if heads % chips or (kv_heads != 1 and kv_heads % chips):
            return f"{heads} heads / {kv_heads} KV heads do not split over {chips} chips"
        return None

    def local_args(self, chips: int, args: Sequence, kwargs) -> list:
        pages = list(args[1:3]) if args[1].shape[0] == 1 else [_local(a, 0, chips) for a in args[1:3]]
        return [_local(args[0], 1, chips), *pages, *args[3:]]

    def wrap(self, fn: Callable, mesh, args: Sequence, kwargs) -> Callable:
        import jax
        from jax.sharding import PartitionSpec as P

        axis = mesh.axis_names[0]
        pages = P() if args[1].shape[0] == 1 else P(axis)
        specs = (P(None, axis), pages, pages) + (P(),) * (len(args) - 3)
        return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(None, axis), check_vma=False)


class OverExpertWeights:
    """Grouped matmul over expert weights split as Megatron splits the experts: the fused
    gate/up weights by their output features (``tp_split="columns"``: lhs whole, the output
    split like the weights), the down weights by their input features (``"rows"``: lhs split
    the same way, each chip's partial sums added over the mesh)."""

    def _dims(self, kwargs):
        """(rhs dim split, lhs dim split or None) for the call's ``tp_split``."""
        transposed = kwargs.get("transpose_rhs", False)
        if kwargs.get("tp_split") == "columns":
            return (1 if transposed else 2), None
        return (2 if transposed else 1), 1

    def problem(self, chips: int, args: Sequence, kwargs) -> Optional[str]:
        split = kwargs.get("tp_split")
        if split not in ("columns", "rows"):
            return f"tp_split={split!r}: the caller did not say how the expert weights are split"
        rhs_dim, _ = self._dims(kwargs)
        if split == "rows" and len(args) > 3 and args[1].shape[1] * 2 == args[0].shape[1]:
            return "packed INT4 experts split by input features would part each byte's two halves"
        if args[1].shape[rhs_dim] % chips:
            return f"expert weights {list(args[1].shape)} do not split over {chips} chips on dim {rhs_dim}"
        return None

    def local_args(self, chips: int, args: Sequence, kwargs) -> list:
        rhs_dim, lhs_dim = self._dims(kwargs)
        lhs = args[0] if lhs_dim is None else _local(args[0], lhs_dim, chips)
        scale = [_local(s, s.dim() - 1, chips) if lhs_dim is None else s for s in args[3:]]  # by output features
        return [lhs, _local(args[1], rhs_dim, chips), args[2], *scale]

    def wrap(self, fn: Callable, mesh, args: Sequence, kwargs) -> Callable:
        import jax
        from jax.sharding import PartitionSpec as P

        axis = mesh.axis_names[0]
        rhs_dim, lhs_dim = self._dims(kwargs)
        rhs_spec = P(*[axis if d == rhs_dim else None for d in range(3)])
        scales = len(args) - 3  # quantized experts' scales (and zeros), split with the output features
        if lhs_dim is None:
            side = tuple(P(*[None] * (s.dim() - 1), axis) for s in args[3:])
            return jax.shard_map(fn, mesh=mesh, in_specs=(P(), rhs_spec, P()) + side,
                                 out_specs=P(None, axis), check_vma=False)

        def summed(*arrays):
            return jax.lax.psum(fn(*arrays), axis)

        return jax.shard_map(summed, mesh=mesh, in_specs=(P(None, axis), rhs_spec, P()) + (P(),) * scales,
                             out_specs=P(), check_vma=False)


class OverLinearWeights:
    """A quantized linear's matmul ``(x, weight [k_rows, n], scale[, zero])`` over weights split
    as Megatron splits the layer (``tp_split``): ``"columns"``, by output features (x whole,
    the output split like the weights); ``"rows"``, by input features (x split the same way,
    each chip's partial sums added over the mesh). Packed INT4 (two input features a byte, half
    of k apart) splits by columns only, and so do activations quantized per token
    (``by_rows=False``: a token's scale is its whole row's maximum). Scales and zeros split with
    their weight's features (per-channel scales of a row split stay whole)."""

    def __init__(self, by_rows: bool = True):
        self.by_rows = by_rows

    def problem(self, chips: int, args: Sequence, kwargs) -> Optional[str]:
        split, (x, weight) = kwargs.get("tp_split"), args[:2]
        if split not in ("columns", "rows"):
            return f"tp_split={split!r}: the caller did not say how the weights are split"
        if split == "rows" and not self.by_rows:
            return "activations quantized per token need each token's whole row on one chip"
        if split == "rows" and x.shape[-1] != weight.shape[0]:
            return "packed INT4 weights split by input features would part each byte's two halves"
        dim = 1 if split == "columns" else 0
        if weight.shape[dim] % chips or any(t.dim() == 2 and t.shape[dim] % chips for t in args[2:]):
            return f"weights {list(weight.shape)} and their scales do not split over {chips} chips on dim {dim}"
        return None

    def local_args(self, chips: int, args: Sequence, kwargs) -> list:
        x, weight, *side = args
        if kwargs.get("tp_split") == "columns":
            return [x, _local(weight, 1, chips), *[_local(t, t.dim() - 1, chips) for t in side]]
        return [_local(x, 1, chips), _local(weight, 0, chips), *[t if t.dim() == 1 else _local(t, 0, chips)
                                                                 for t in side]]

    def wrap(self, fn: Callable, mesh, args: Sequence, kwargs) -> Callable:
        import jax
        from jax.sharding import PartitionSpec as P

        axis = mesh.axis_names[0]
        side = args[2:]
        if kwargs.get("tp_split") == "columns":
            specs = (P(), P(None, axis)) + tuple(P(*[None] * (t.dim() - 1), axis) for t in side)
            return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(None, axis), check_vma=False)

        def summed(*arrays):
            return jax.lax.psum(fn(*arrays), axis)

        specs = (P(None, axis), P(axis, None)) + tuple(P() if t.dim() == 1 else P(axis, None) for t in side)
        return jax.shard_map(summed, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)


HEADS = OverHeads()
EXPERT_WEIGHTS = OverExpertWeights()
LINEAR_WEIGHTS = OverLinearWeights()
TOKEN_QUANTIZED_LINEAR_WEIGHTS = OverLinearWeights(by_rows=False)
