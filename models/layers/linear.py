"""Megatron-style parallel linears and vocabulary layers, weights in ``[in, out]`` layout.

XLA's CPU backend materialises the transpose of ``x @ W.T`` on every call (the SmolLM2 LM
head took 122 ms that way and 8 ms with a pre-transposed weight), so matmul weights are
stored transposed once at load time. After loading, a layer may switch to INT8 weights or to
one of the CPU-only matmul forms of ``cpu_matmul.py``; TPUs keep ``[in, out]``.

Each rank keeps its shard: column-parallel layers split the output features (no
communication; the output stays sharded), row-parallel layers split the input features and
sum the partial products with ``all_reduce``. Every parameter carries a ``weight_loader(param,
loaded, shard_id)`` that takes the full checkpoint tensor in Hugging Face layout (``[out, in]``)
and writes this rank's shard. Packed layers (QKV, gate/up) hold several checkpoint tensors;
``shard_ids`` on the parameter lists them so loading can check that each arrived once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from tpu_executor.kernels.w4a16_matmul.ops import w4a16_matmul
from tpu_executor.kernels.w4a16_matmul.reference import quantize_int4
from tpu_executor.kernels.w8a8_matmul.ops import w8a8_matmul
from tpu_executor.kernels.w8a16_matmul.ops import w8a16_matmul
from tpu_executor.kernels.w8a16_matmul.reference import quantize_per_channel
from tpu_executor.models.layers.cpu_matmul import (
    XLA_CPU_OUT_IN_BELOW,
    cpu_packed,
    cpu_packed_matmul,
    packable_for_cpu,
    xla_cpu_small_matmul,
)
from tpu_executor.models.layers.lora import LoRASlots, check_shape
from tpu_executor.models.layers.parallel import TensorParallelGroup, divide, kv_heads_of_rank


def copy_weight(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Default loader: the checkpoint tensor has our layout."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"shape {tuple(loaded.shape)} in the checkpoint, the model expects {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def copy_from_hf(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy a Hugging Face tensor (``[out, in]`` weight or ``[out]`` bias) into our layout."""
    copy_weight(param, loaded.t() if loaded.dim() == 2 else loaded)


def weight_loader(param: torch.Tensor):
    return getattr(param, "weight_loader", copy_weight)


def narrow_checked(loaded: torch.Tensor, dim: int, start: int, length: int, full: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)`` after checking that ``dim`` has size ``full``."""
    if loaded.shape[dim] != full:
        raise ValueError(f"dimension {dim} is {loaded.shape[dim]} in the checkpoint, the model expects {full}")
    return loaded.narrow(dim, start, length)


@dataclass(frozen=True)
class Placement:
    """Where one checkpoint tensor (Hugging Face layout, ``[out, in]``) goes in a layer: the
    slice of it along ``dim`` this rank keeps, and the view of our parameter (``[..., in, out]``)
    it fills: expert ``expert``'s, output features ``[offset, offset + width)`` (None: all)."""

    dim: int
    start: int
    length: int
    full: int
    expert: Optional[int] = None
    offset: int = 0
    width: Optional[int] = None

    def take(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``loaded``."""
        return narrow_checked(loaded, self.dim, self.start, self.length, self.full)

    def view(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param`` the slice fills."""
        part = param if self.expert is None else param[self.expert]
        return part if self.width is None else part.narrow(-1, self.offset, self.width)

    def coarser(self, per: int) -> "Placement":
        """The placement of a tensor with one entry per ``per`` input features (group scales)."""
        if self.dim == 0:
            return self
        return replace(self, start=self.start // per, length=self.length // per, full=self.full // per)

    def copy(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy this rank's slice of ``loaded`` into its view of ``param``."""
        copy_from_hf(self.view(param), self.take(loaded))


# (offset in our shard, start in the checkpoint tensor, length, checkpoint size), along outputs
OutputShard = Tuple[int, int, int, int]


# Input features per INT4 scale, the largest of these that divides half a weight's inputs.
INT4_GROUPS = (128, 64, 32, 16)


def int4_group(in_features: int) -> Optional[int]:
    """The INT4 group of a weight with ``in_features`` inputs (None: no group fits)."""
    half = in_features // 2
    return next((g for g in INT4_GROUPS if in_features % 2 == 0 and half % g == 0), None)


def quantize_parameter(module: nn.Module, name: str, scheme: str = "int8") -> None:
    """Replace parameter ``name`` (``[..., in, out]``) by its quantized form: ``int8``:
    ``{name}_q`` (int8) and ``{name}_scale`` (fp32, one per output channel); ``int4``:
    ``{name}_q4`` (two weights a byte, ``w4a16_matmul``'s layout) and ``{name}_scale`` (fp32,
    one per group of ``INT4_GROUPS`` inputs and output), symmetric."""
    weight = getattr(module, name).data
    if scheme in ("int8", "w8a8"):  # w8a8: the layer's ``activation_bits`` says the rest
        tensors = dict(zip(("_q", "_scale"), quantize_per_channel(weight)))
    elif scheme == "int4":
        group = int4_group(weight.shape[-2])
        if group is None:
            raise ValueError(f"INT4 needs an even number of input features whose half a group of {INT4_GROUPS} "
                             f"divides; {type(module).__name__}.{name} has {weight.shape[-2]}")
        packed, scale, _ = quantize_int4(weight, group)
        tensors = {"_q4": packed, "_scale": scale}
    else:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    delattr(module, name)
    for suffix, tensor in tensors.items():
        module.register_parameter(name + suffix, nn.Parameter(tensor, requires_grad=False))


class QuantizableMatmul(nn.Module):
    """``x @ weight`` that can switch, after loading, to quantized weights: INT8 with
    per-output-channel scales (W8A16, the ``w8a16_matmul`` op; with INT8 activations, W8A8,
    ``w8a8_matmul``) or INT4 with group-wise scales (W4A16, ``w4a16_matmul``); or, on a CPU,
    to the matmul forms measured faster there (``cpu_matmul.py``)."""

    quantizable = True
    activation_bits: Optional[int] = None  # 8: activations quantized per token (W8A8)
    tp_split = "columns"  # how a mesh splits the weight (JAX SPMD): by output or input ("rows") features

    def quantize(self, scheme: str) -> None:
        """Replace ``weight`` by its ``scheme`` form (see ``quantize_parameter``); ``w8a8``
        also quantizes the layer's activations."""
        quantize_parameter(self, "weight", scheme)
        self.activation_bits = 8 if scheme == "w8a8" else None

    def pack_for_cpu(self) -> bool:
        """Replace an fp32 CPU ``weight`` by ``weight_packed`` (``cpu_matmul.cpu_packed``'s form,
        a buffer that is not saved); returns whether it did. Call after loading, on the native
        CPU path only."""
        if not packable_for_cpu(self._parameters.get("weight")):
            return False
        packed, self.packed_out_features = cpu_packed(self.weight), self.weight.shape[1]
        delattr(self, "weight")
        self.register_buffer("weight_packed", packed, persistent=False)
        return True

    def use_xla_cpu_form(self) -> bool:
        """On XLA's CPU backend, give a small layer ``weight_out_in`` (the transpose of its
        ``weight``, a buffer that is not saved) for prefill-sized inputs, where that dot form
        is faster; returns whether it did. Call after loading; TPUs keep ``[in, out]`` only."""
        weight = self._parameters.get("weight")
        if weight is None or weight.dtype != torch.float32 or max(weight.shape) >= XLA_CPU_OUT_IN_BELOW:
            return False  # measured for fp32 only
        self.register_buffer("weight_out_in", weight.detach().t().contiguous(), persistent=False)
        return True

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if "input_order" in self._buffers:  # an act-order checkpoint's weight, rows sorted by group
            x = x.index_select(-1, self.input_order)
        if "weight_q" in self._parameters:
            matmul = w8a8_matmul if self.activation_bits == 8 else w8a16_matmul
            return matmul(x, self.weight_q, self.weight_scale, tp_split=self.tp_split)
        if "weight_q4" in self._parameters:  # packed bytes split by output features on a mesh
            return w4a16_matmul(x, self.weight_q4, self.weight_scale, self._parameters.get("weight_zero"),
                                tp_split="columns")
        if "weight_packed" in self._buffers:
            return cpu_packed_matmul(x, self.weight_packed, self.packed_out_features)
        if "weight_out_in" in self._buffers:
            return xla_cpu_small_matmul(x, self.weight, self.weight_out_in)
        return x @ self.weight


class ColumnParallelLinear(QuantizableMatmul, LoRASlots):
    """``y = x @ W + b`` keeping this rank's slice of the output features (plus each token's
    LoRA update, when the layer serves adapters).

    ``shards`` maps a checkpoint tensor (``shard_id``) to where its rows go; a plain
    column-parallel layer has the one shard ``None``.
    """

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, bias: bool = False,
                 shards: Optional[Dict[object, OutputShard]] = None):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        if shards is None:
            local = divide(out_features, tp.world_size, "output features")
            shards = {None: (0, tp.rank * local, local, out_features)}
        self.shards = shards
        self.out_local = sum(length for _, _, length, _ in shards.values())
        self.weight = nn.Parameter(torch.empty(in_features, self.out_local))
        self.bias = nn.Parameter(torch.zeros(self.out_local)) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load
                param.shard_ids = tuple(shards)

    def placement(self, name: str, shard_id=None) -> Placement:
        """Where checkpoint tensor ``shard_id`` of ``name`` (weight or bias) goes: its rows."""
        if shard_id not in self.shards:
            raise ValueError(f"no shard {shard_id!r} in this layer (it packs {list(self.shards)})")
        offset, start, length, full = self.shards[shard_id]
        return Placement(0, start, length, full, offset=offset, width=length)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        self.placement("weight", shard_id).copy(param, loaded)

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.matmul(x)
        delta = self.lora_delta(x, lora_slots)
        y = y if delta is None else y + delta
        return y if self.bias is None else y + self.bias

    def _lora_shapes(self, max_rank: int) -> Tuple[int, int]:
        return self.in_features, len(self.shards) * max_rank  # A whole, a rank's columns per packed shard

    def _lora_out(self) -> int:
        return self.out_local

    def _lora_slices(self):
        """Each packed projection's (first feature, features), in the order of its rank columns."""
        return tuple((offset, length) for offset, _, length, _ in self.shards.values()) if len(self.shards) > 1 \
            else None

    def _lora_parts(self, shard_id, lora_a: torch.Tensor, lora_b: torch.Tensor):
        if shard_id not in self.shards:
            raise ValueError(f"no shard {shard_id!r} in this layer (it packs {list(self.shards)})")
        offset, start, length, full = self.shards[shard_id]
        check_shape("lora_A", lora_a, (lora_a.shape[0], self.in_features))
        check_shape("lora_B", lora_b, (full, lora_a.shape[0]))
        column = list(self.shards).index(shard_id) * self.lora_rank
        return lora_a, lora_b[start:start + length], column, (offset, length)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): shard ``i`` is the
    ``i``-th checkpoint tensor; each rank holds its slice of every one, side by side."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], tp: TensorParallelGroup, bias: bool = False):
        shards, offset = {}, 0
        for index, size in enumerate(out_sizes):
            local = divide(size, tp.world_size, "intermediate_size")
            shards[index] = (offset, tp.rank * local, local, size)
            offset += local
        super().__init__(in_features, offset, tp, bias, shards)


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul: this rank's query heads and its KV heads.

    With more ranks than KV heads each KV head is replicated on consecutive ranks, so every
    rank holds the KV head its query heads attend to.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 tp: TensorParallelGroup, bias: bool = False):
        self.num_heads = divide(num_heads, tp.world_size, "num_attention_heads")
        kv_start, self.num_kv_heads = kv_heads_of_rank(num_kv_heads, tp.rank, tp.world_size)
        q_size, kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        shards = {"q": (0, tp.rank * q_size, q_size, num_heads * head_dim),
                  "k": (q_size, kv_start * head_dim, kv_size, num_kv_heads * head_dim),
                  "v": (q_size + kv_size, kv_start * head_dim, kv_size, num_kv_heads * head_dim)}
        super().__init__(hidden_size, q_size + 2 * kv_size, tp, bias, shards)
        self.split_sizes = (q_size, kv_size, kv_size)


class RowParallelLinear(QuantizableMatmul, LoRASlots):
    """``y = all_reduce(x_local @ W_local) + b``: this rank's slice of the input features.

    The bias is added once, after the sum; a LoRA update's partial product joins the base
    layer's before it.
    """

    tp_split = "rows"

    def __init__(self, in_features: int, out_features: int, tp: TensorParallelGroup, bias: bool = False):
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.in_local = divide(in_features, tp.world_size, "input features")
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(self.in_local, out_features))
        self.weight.weight_loader = self._load
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = copy_weight

    def placement(self, name: str, shard_id=None) -> Placement:
        """Where the checkpoint's weight goes: its columns of this rank's input features."""
        return Placement(1, self.tp.rank * self.in_local, self.in_local, self.in_features)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        self.placement("weight").copy(param, loaded)

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.matmul(x)
        delta = self.lora_delta(x, lora_slots)
        y = self.tp.all_reduce(y if delta is None else y + delta)
        return y if self.bias is None else y + self.bias

    def _lora_shapes(self, max_rank: int) -> Tuple[int, int]:
        return self.in_local, max_rank  # A's rows of this rank's input features, B whole

    def _lora_out(self) -> int:
        return self.out_features

    def _lora_slices(self):
        return None  # one projection

    def _lora_parts(self, shard_id, lora_a: torch.Tensor, lora_b: torch.Tensor):
        check_shape("lora_A", lora_a, (lora_a.shape[0], self.in_features))
        check_shape("lora_B", lora_b, (self.out_features, lora_a.shape[0]))
        start = self.tp.rank * self.in_local
        return lora_a[:, start:start + self.in_local], lora_b, 0, (0, self.out_features)


class VocabParallelEmbedding(nn.Module):
    """Token embedding split over the vocabulary, stored ``[vocab / tp, hidden]`` (the
    checkpoint's layout): a lookup gathers whole rows of it as stored, and the (tied) LM head
    is ``h @ W.T``, which a TPU's matmul reads in that layout as cheaply as ``h @ W``. Stored
    ``[hidden, vocab]``, every lookup made XLA copy the whole table into the other layout first.

    The vocabulary is padded to a multiple of the group size; padded columns stay zero.
    A rank looks up the ids it owns, zeroes the rest, and the group sums the rows.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden_size))
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        # The last rank's slice may run past the vocabulary: those columns are padding.
        start = min(self.vocab_start, self.vocab_size)
        length = min(self.vocab_local, self.vocab_size - start)
        rows = narrow_checked(loaded, 0, start, length, self.vocab_size)
        copy_weight(param.narrow(0, 0, length), rows)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.weight.index_select(0, token_ids)
        local_ids = token_ids - self.vocab_start
        owned = (local_ids >= 0) & (local_ids < self.vocab_local)
        rows = self.weight.index_select(0, torch.where(owned, local_ids, 0))
        return self.tp.all_reduce(rows * owned[:, None].to(rows.dtype))

    def pack_for_cpu(self) -> bool:
        """Add ``logits_packed``, the weight in ``cpu_matmul.cpu_packed``'s form for ``logits``
        (the lookup keeps ``weight``); returns whether it did. Native CPU path, after loading."""
        if not packable_for_cpu(self._parameters.get("weight")):
            return False
        self.packed_out_features = self.weight.shape[0]
        self.register_buffer("logits_packed", cpu_packed(self.weight.t()), persistent=False)
        return True

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[T, vocab]`` (each rank computes its slice, then gathers)."""
        if "logits_packed" in self._buffers:
            local = cpu_packed_matmul(hidden, self.logits_packed, self.packed_out_features)
        else:
            local = hidden @ self.weight.t()
        logits = self.tp.all_gather(local)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., :self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same sharding as the embedding; use ``logits(hidden)``."""

    def pack_for_cpu(self) -> bool:
        """As the embedding's, but the head never looks tokens up: its ``weight`` is dropped."""
        if not super().pack_for_cpu():
            return False
        delattr(self, "weight")
        return True
