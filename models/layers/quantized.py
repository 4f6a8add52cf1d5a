"""Layers built for a published quantized checkpoint's weights (compressed-tensors, GPTQ, AWQ).

A format reader turns each quantized weight into a ``QuantizedWeight``: signed integer levels
in Hugging Face layout ``[out, in]``, a scale per group of input features, an optional zero
point and, for act-order checkpoints, the group of each input feature. Before loading, every
layer the checkpoint quantized swaps its weight for staging parameters (``prepare_quantized``):
the levels unpacked (int8, ``[..., in, out]``), scales and zeros with one row per group of this
rank. Each ``QuantizedWeight`` lands through the layer's own ``placement`` (the same slices as
its unquantized weight); ``finish_quantized`` then packs INT4 levels two a byte and drops
zero points that are all zero, leaving the forms ``w8a16_matmul`` and ``w4a16_matmul`` take.

The group kept here divides the checkpoint's: a checkpoint group that straddles two ranks, or
the halves of an INT4 weight's packed bytes, is split by repeating its scale (exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tpu_executor.kernels.w4a16_matmul.reference import pack
from tpu_executor.models.layers.linear import Placement, copy_weight


@dataclass
class QuantizedWeight:
    """One quantized weight of a checkpoint, ``(values - zero) * scale``, Hugging Face layout.

    ``values``: int8 ``[out, in]``, signed levels (``[-8, 7]`` for 4 bits; FP8 E4M3 values for
    an FP8 checkpoint); ``scale``: fp32
    ``[out, in // group]``; ``zero``: fp32 like ``scale`` (the signed level of 0) or None
    (symmetric); ``groups``: int64 ``[in]``, each input feature's group for act-order weights
    (None: feature ``i`` is in group ``i // group``)."""

    values: torch.Tensor
    scale: torch.Tensor
    zero: Optional[torch.Tensor]
    bits: int
    groups: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class QuantizedLayout:
    """How a checkpoint stores its quantized weights: ``bits`` (4 or 8), ``group`` input
    features a scale (None: one per output channel), zero points or not, act order or not."""

    bits: int
    group: Optional[int]
    symmetric: bool = True
    act_order: bool = False
    floating: bool = False  # FP8 (E4M3) values, not integer levels
    activation_bits: Optional[int] = None  # 8: INT8 activations per token (W8A8; linears, not experts)

    def bytes_per_weight(self) -> float:
        """Bytes a weight takes as loaded: its bits, and its group's fp32 scale (and zero)."""
        per_group = 4 * (1 if self.symmetric else 2) / self.group if self.group else 0.0
        return self.bits / 8 + per_group


def prepare_quantized(module: nn.Module, name: str, layout: QuantizedLayout) -> None:
    """Swap parameter ``name`` (``[..., in, out]``) of ``module`` for the staging parameters a
    ``QuantizedWeight`` loads into: ``{name}_q`` (int8 levels, carrying the loader and the
    weight's shard ids), ``{name}_scale`` and ``{name}_zero`` (fp32, a row per kept group)."""
    weight = getattr(module, name)
    *lead, in_local, out = weight.shape
    halves = in_local // 2 if layout.bits == 4 else in_local  # an INT4 group stays within a half
    kept = math.gcd(layout.group, halves) if layout.group else halves
    if layout.act_order and lead:
        raise ValueError(f"act-order weights load into dense linears only, not {type(module).__name__}.{name}")
    dtype = torch.float8_e4m3fn if layout.floating else torch.int8
    q = nn.Parameter(torch.empty(*lead, in_local, out, dtype=dtype, device=weight.device), requires_grad=False)
    q.weight_loader = lambda param, loaded, shard_id=None: load_quantized(module, name, loaded, shard_id)
    q.shard_ids = getattr(weight, "shard_ids", (None,))
    delattr(module, name)
    module.register_parameter(name + "_q", q)
    for suffix in ("_scale",) if layout.symmetric else ("_scale", "_zero"):
        part = nn.Parameter(torch.empty(*lead, in_local // kept, out, device=weight.device), requires_grad=False)
        part.shard_ids = ()  # loaded with the levels
        module.register_parameter(name + suffix, part)
    if layout.act_order:
        module.register_buffer("input_order", torch.full((in_local,), -1, device=weight.device))
    module.quantized_bits = layout.bits
    if hasattr(module, "activation_bits"):
        module.activation_bits = layout.activation_bits


def load_quantized(module: nn.Module, name: str, loaded: QuantizedWeight, shard_id) -> None:
    """Load ``loaded`` (checkpoint shard ``shard_id``) into ``module``'s staging parameters
    through the layer's ``placement``: the levels as the weight, scales and zeros by group."""
    if not isinstance(loaded, QuantizedWeight):
        raise ValueError("the layer was built for a quantized weight; the checkpoint holds a plain tensor")
    if loaded.bits != module.quantized_bits or loaded.values.dtype != getattr(module, name + "_q").dtype:
        raise ValueError(f"{loaded.bits}-bit {loaded.values.dtype} weights in a layer built for "
                         f"{module.quantized_bits}-bit {getattr(module, name + '_q').dtype}")
    placement = module.placement(name, shard_id)
    if (loaded.groups is not None) != ("input_order" in module._buffers):
        raise ValueError("act-order group indices where the checkpoint's config says none, or the reverse")
    if loaded.groups is not None:
        loaded = _in_group_order(module, placement, loaded)
    levels = getattr(module, name + "_q")
    copy_weight(placement.view(levels), placement.take(loaded.values).t())
    kept = levels.shape[-2] // getattr(module, name + "_scale").shape[-2]
    for suffix, part in (("_scale", loaded.scale), ("_zero", loaded.zero)):
        target = module._parameters.get(name + suffix)
        if (part is None) != (target is None):
            raise ValueError("zero points where the checkpoint's config says symmetric, or none where it says not")
        if part is not None:
            per_group = loaded.values.shape[-1] // part.shape[-1]
            if per_group % kept:
                raise ValueError(f"groups of {per_group} input features do not split into this layer's {kept}")
            finer = part.float().repeat_interleave(per_group // kept, dim=-1)
            copy_weight(placement.coarser(kept).view(target), placement.coarser(kept).take(finer).t())


def _in_group_order(module: nn.Module, placement: Placement, loaded: QuantizedWeight) -> QuantizedWeight:
    """An act-order weight with this rank's input features sorted by group (the layer's
    ``input_order`` gathers its input the same way), so that each group is contiguous. Refused
    where a rank would hold part of a group."""
    start, length = (placement.start, placement.length) if placement.dim == 1 else (0, loaded.values.shape[-1])
    group = loaded.values.shape[-1] // loaded.scale.shape[-1]
    groups = loaded.groups[start:start + length].long()
    counts = torch.bincount(groups, minlength=loaded.scale.shape[-1])
    if bool(((counts != 0) & (counts != group)).any()):
        raise ValueError(f"act-order groups of {group} input features straddle the ranks at this tensor-parallel "
                         "size (or the group indices are not whole groups); tensor_parallel_size 1 keeps them whole")
    order = torch.sort(groups, stable=True).indices
    if int(module.input_order[0]) >= 0 and not torch.equal(module.input_order, order):
        raise ValueError("the projections packed in this layer were quantized in different act orders")
    module.input_order.copy_(order)
    kept_groups = torch.unique_consecutive(groups[order])
    first = start // group

    def reorder(tensor: Optional[torch.Tensor], columns: torch.Tensor, at: int) -> Optional[torch.Tensor]:
        if tensor is None:
            return None
        out = tensor.clone()
        out[:, at:at + len(columns)] = tensor[:, columns]
        return out

    return QuantizedWeight(reorder(loaded.values, start + order, start), reorder(loaded.scale, kept_groups, first),
                           reorder(loaded.zero, kept_groups, first), loaded.bits)


def finish_quantized(module: nn.Module, name: str) -> None:
    """Turn the loaded staging parameters into the matmul's forms: INT4 levels packed into
    ``{name}_q4``, per-channel INT8 scales as ``[..., out]``, all-zero zero points dropped."""
    zero = module._parameters.get(name + "_zero")
    if zero is not None and not zero.is_meta and not bool(zero.any()):
        delattr(module, name + "_zero")
    scale = getattr(module, name + "_scale")
    if module.quantized_bits == 8:
        if module._parameters.get(name + "_zero") is not None:
            raise ValueError("INT8 weights with zero points are not supported (the INT8 matmul is symmetric)")
        if scale.shape[-2] == 1:
            module._parameters[name + "_scale"] = nn.Parameter(scale.data.squeeze(-2), requires_grad=False)
        return
    levels = module._parameters.pop(name + "_q")
    module.register_parameter(name + "_q4", nn.Parameter(pack(levels.data), requires_grad=False))
