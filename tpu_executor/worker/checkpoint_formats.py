"""Published quantized checkpoint formats: the scheme a checkpoint's ``quantization_config``
names, and its tensors read as ``QuantizedWeight`` (signed levels, fp32 scales and zeros,
Hugging Face layout) for the layers of ``models/layers/quantized.py``.

- compressed-tensors (llm-compressor): ``pack-quantized`` (``weight_packed`` int32, levels
  offset to unsigned and packed low bits first along the input features; ``weight_shape``;
  asymmetric zero points ``weight_zero_point`` packed along the output features),
  ``int-quantized`` / ``naive-quantized`` (``weight`` int8), ``float-quantized`` (``weight``
  FP8 E4M3); ``weight_scale`` ``[out, in / group]`` (``[out, 1]`` per channel, one value per
  tensor); ``weight_g_idx`` with ``actorder: group``.
- GPTQ (AutoGPTQ / GPTQModel): ``qweight`` int32 ``[in / (32 / bits), out]`` packed along the
  input features, ``qzeros`` int32 ``[in / group, out / (32 / bits)]`` packed along the
  output features, storing zero - 1 (``checkpoint_format: gptq``; ``gptq_v2`` stores zero),
  ``scales`` ``[in / group, out]``, ``g_idx`` ``[in]``; unsigned levels: ``(q - zero) * scale``.
- AWQ (AutoAWQ, GEMM): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` ``[in / group,
  out / 8]`` packed along the output features in the order 0, 2, 4, 6, 1, 3, 5, 7;
  ``scales`` ``[in / group, out]``; unsigned levels: ``(q - zero) * scale``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, Optional, Set, Tuple

import torch

from tpu_executor.models.layers.quantized import QuantizedLayout, QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed slot i holds output feature AWQ_ORDER[i] of its 8
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a format or scheme this engine does not load."""


@dataclass(frozen=True)
class CheckpointScheme:
    """A published checkpoint's quantization: ``method`` (compressed-tensors, gptq, awq), its
    storage ``format`` and the ``layout`` of its weights."""

    method: str
    format: str
    layout: QuantizedLayout
    gptq_zero_offset: int = 0  # GPTQ's v1 format stores zero - 1

    @property
    def parts(self) -> Tuple[str, ...]:
        """Suffixes of the tensors one quantized weight is stored in."""
        if self.method == "compressed-tensors":
            first = ("weight_packed", "weight_shape") if self.format == "pack-quantized" else ("weight",)
            return first + ("weight_scale",) + (() if self.layout.symmetric else ("weight_zero_point",)) + \
                (("weight_g_idx",) if self.layout.act_order else ())
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.method == "gptq" else ())


def checkpoint_scheme(hf_config) -> Optional[CheckpointScheme]:
    """The scheme of the checkpoint whose config is ``hf_config`` (None: not quantized);
    a format or scheme we do not load is refused, naming it."""
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    method = config.get("quant_method")
    readers = {"compressed-tensors": _compressed_tensors_scheme, "gptq": _gptq_scheme, "awq": _awq_scheme}
    if method not in readers:
        raise UnsupportedQuantization(f"the checkpoint is quantized with {method!r}; this engine loads "
                                      f"{sorted(readers)} checkpoints")
    return readers[method](config)


def _compressed_tensors_scheme(config: dict) -> CheckpointScheme:
    groups = list((config.get("config_groups") or {}).values())
    weights = [g.get("weights") for g in groups]
    if not groups or any(w is None for w in weights) or any(w != weights[0] for w in weights):
        raise UnsupportedQuantization("compressed-tensors checkpoints with several weight schemes (or none) "
                                      "are not supported: one weight scheme for every quantized layer")
    args, fmt = weights[0], groups[0].get("format") or config.get("format")
    activations = [g.get("input_activations") for g in groups]
    if args.get("type", "int") == "float":
        return _fp8_scheme(args, fmt, activations)
    activation_bits = _int8_activations(activations, args) if any(activations) else None
    if fmt not in CT_FORMATS:
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r} with {args.get('type')} weights is not "
                                      f"supported: integer weights in {CT_FORMATS} load, and FP8")
    strategy = args.get("strategy")
    if strategy not in ("group", "channel") or args.get("num_bits") not in (4, 8):
        raise UnsupportedQuantization(f"compressed-tensors {args.get('num_bits')}-bit weights quantized by "
                                      f"{strategy!r} are not supported: 4 or 8 bits, by group or by channel")
    layout = QuantizedLayout(args["num_bits"], args.get("group_size") if strategy == "group" else None,
                             bool(args.get("symmetric", True)), args.get("actorder") == "group",
                             activation_bits=activation_bits)
    return CheckpointScheme("compressed-tensors", fmt, layout)


def _int8_activations(activations, weights: dict) -> int:
    """8 for W8A8 as llm-compressor writes it (INT8 activations quantized per token,
    dynamically and symmetrically, over INT8 weights per channel); any other activation
    scheme is refused, naming what it is."""
    args = activations[0]
    w8a8 = all(a == args for a in activations) and args.get("type", "int") == "int" and args.get("num_bits") == 8 \
        and args.get("strategy") == "token" and args.get("dynamic") and args.get("symmetric", True) \
        and weights.get("num_bits") == 8 and weights.get("strategy") == "channel" and weights.get("symmetric", True)
    if not w8a8:
        raise UnsupportedQuantization(
            f"compressed-tensors activations {args.get('num_bits')}-bit {args.get('type')} by {args.get('strategy')!r} "
            f"(dynamic: {args.get('dynamic')}) over {weights.get('num_bits')}-bit weights by "
            f"{weights.get('strategy')!r} are not supported: W8A8 loads as INT8 weights per channel with dynamic, "
            "symmetric INT8 activations per token")
    return 8


def _fp8_scheme(args: dict, fmt: str, activations) -> CheckpointScheme:
    """FP8 (E4M3) weights, one scale per output channel or per tensor. Activations quantized
    dynamically (FP8_DYNAMIC) run unquantized: the weights are upcast inside the matmul."""
    if args.get("num_bits") != 8 or fmt not in ("float-quantized", "naive-quantized") or \
            args.get("strategy") not in ("channel", "tensor"):
        raise UnsupportedQuantization(f"compressed-tensors {args.get('num_bits')}-bit float weights in {fmt!r} by "
                                      f"{args.get('strategy')!r} are not supported: FP8 by channel or tensor loads")
    if any(a and not a.get("dynamic") for a in activations):
        raise UnsupportedQuantization("FP8 with static activation scales is not supported: weight-only FP8 and "
                                      "FP8 with dynamic activation scales (run unquantized) load")
    return CheckpointScheme("compressed-tensors", "float-quantized", QuantizedLayout(8, None, floating=True))


def _gptq_scheme(config: dict) -> CheckpointScheme:
    bits, group = config.get("bits"), config.get("group_size", -1)
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"GPTQ with {bits}-bit weights is not supported: 4 or 8 bits load")
    fmt = config.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint format {fmt!r} is not supported: gptq or gptq_v2")
    layout = QuantizedLayout(bits, None if group in (-1, None) else group, bool(config.get("sym", True)),
                             bool(config.get("desc_act", False)))
    return CheckpointScheme("gptq", fmt, layout, gptq_zero_offset=1 if fmt == "gptq" else 0)


def _awq_scheme(config: dict) -> CheckpointScheme:
    version = str(config.get("version", "gemm")).lower()
    if version != "gemm" or config.get("bits", config.get("w_bit", 4)) != 4:
        raise UnsupportedQuantization(f"AWQ {version!r} with {config.get('bits')}-bit weights is not supported: "
                                      "the GEMM layout, 4 bits, loads")
    group = config.get("group_size", config.get("q_group_size", 128))
    return CheckpointScheme("awq", "gemm", QuantizedLayout(4, group, not config.get("zero_point", True)))


def quantized_weights(scheme: CheckpointScheme, names: Iterable[str]) -> Set[str]:
    """The ``<module>.weight`` names whose quantized tensors ``names`` holds (a quantized
    weight is the one with a scale)."""
    marker = "." + ("weight_scale" if scheme.method == "compressed-tensors" else "scales")
    return {name[:-len(marker)] + ".weight" for name in names if name.endswith(marker)}


def read_quantized(scheme: CheckpointScheme, tensors: Iterable[Tuple[str, torch.Tensor]],
                   names: Iterable[str]) -> Iterator[Tuple[str, object]]:
    """The checkpoint's tensors with each quantized weight's parts (wherever their shards put
    them) read as one ``<module>.weight`` ``QuantizedWeight``; other tensors as they are."""
    weights = quantized_weights(scheme, names)
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, suffix = name.rpartition(".")
        if prefix + ".weight" not in weights or suffix not in scheme.parts:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[suffix] = tensor
        if len(parts) == len(scheme.parts):
            yield prefix + ".weight", _DECODERS[scheme.method](scheme, pending.pop(prefix))
    if pending:
        prefix, parts = next(iter(pending.items()))
        raise ValueError(f"{prefix}: the checkpoint holds {sorted(parts)} of its quantized weight's "
                         f"{list(scheme.parts)}")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """Unsigned ``bits``-bit fields of int32 ``packed``, low bits first, spread along ``dim``
    (slot ``i`` of each word is entry ``order[i]`` of its run when ``order`` is given)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., per_word]
    if order is not None:
        fields = fields[..., torch.argsort(torch.tensor(order))]
    fields = fields.movedim(-1, dim + 1) if dim == 0 else fields
    shape = list(packed.shape)
    shape[dim] *= per_word
    return fields.reshape(shape).to(torch.int16)


def _compressed_tensors(scheme: CheckpointScheme, parts: Dict[str, torch.Tensor]) -> QuantizedWeight:
    bits, offset = scheme.layout.bits, 1 << (scheme.layout.bits - 1)
    if scheme.format == "pack-quantized":
        out, k = (int(v) for v in parts["weight_shape"])
        values = (unpack_int32(parts["weight_packed"], bits, 1)[:, :k] - offset).to(torch.int8)
    else:
        values = parts["weight"].to(torch.float8_e4m3fn if scheme.layout.floating else torch.int8)
    scale = parts["weight_scale"].float()
    if scale.numel() == 1:  # one scale for the tensor: the same for every output channel
        scale = scale.reshape(1, 1).expand(values.shape[0], 1)
    zero = parts.get("weight_zero_point")
    if zero is not None and scheme.format == "pack-quantized":
        zero = unpack_int32(zero, bits, 0)[:values.shape[0]] - offset
    return QuantizedWeight(values, scale, None if zero is None else zero.float(), bits,
                           parts.get("weight_g_idx"))


def _gptq(scheme: CheckpointScheme, parts: Dict[str, torch.Tensor]) -> QuantizedWeight:
    bits, offset = scheme.layout.bits, 1 << (scheme.layout.bits - 1)
    values = (unpack_int32(parts["qweight"], bits, 0) - offset).t().to(torch.int8)
    zero = unpack_int32(parts["qzeros"], bits, 1)[:, :values.shape[0]] + scheme.gptq_zero_offset - offset
    groups = parts["g_idx"].long()
    if not scheme.layout.act_order and \
            not torch.equal(groups, torch.arange(len(groups)) // (len(groups) // parts["scales"].shape[0])):
        raise ValueError("g_idx puts input features out of group order, but the config says desc_act: false")
    return QuantizedWeight(values, parts["scales"].float().t(), _zero_unless_symmetric(scheme, zero.t()), bits,
                           groups if scheme.layout.act_order else None)


def _awq(scheme: CheckpointScheme, parts: Dict[str, torch.Tensor]) -> QuantizedWeight:
    values = (unpack_int32(parts["qweight"], 4, 1, AWQ_ORDER) - 8).t().to(torch.int8)
    zero = unpack_int32(parts["qzeros"], 4, 1, AWQ_ORDER) - 8
    return QuantizedWeight(values, parts["scales"].float().t(), _zero_unless_symmetric(scheme, zero.t()), 4)


def _zero_unless_symmetric(scheme: CheckpointScheme, zero: torch.Tensor) -> Optional[torch.Tensor]:
    """GPTQ and AWQ store zero points even for symmetric weights (the middle level): those
    are dropped; a symmetric config over other zero points keeps them (and the load refuses)."""
    return None if scheme.layout.symmetric and not bool(zero.any()) else zero.float()


_DECODERS = {"compressed-tensors": _compressed_tensors, "gptq": _gptq, "awq": _awq}

