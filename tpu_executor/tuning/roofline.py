"""A roofline cost model of one model call on a TPU slice, and whether a model fits its HBM.

A call takes the longer of its FLOPs at peak and its HBM bytes at full bandwidth, plus, with
tensor parallelism, two all-reduces per layer over ICI. It is an estimate of the best case:
real kernels reach a fraction of peak, which ``check_against`` measures on this machine.

The chips and slices are ``core/tpu_slices.py``'s table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tpu_executor.core.buckets import DecodeGraph, PrefillGraph
from tpu_executor.core.tpu_slices import GIB, TPUS, Chip, Target  # noqa: F401 - the cost model's chips and slices

ALL_REDUCE_LATENCY_S = 10e-6  # our assumption per collective hop setup; not a published figure


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a transformer (from its Hugging Face config)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 1
    experts_per_token: int = 1
    checkpoint_weight_bytes: Optional[float] = None  # a published quantized checkpoint's, per layer weight

    @classmethod
    def from_hf_config(cls, hf) -> "ModelShape":
        """The shape of a (text) config; a mixture of experts counts its expert size (Mixtral's
        ``intermediate_size``, Qwen3-MoE's ``moe_intermediate_size``) on every layer. A quantized
        checkpoint's layer weights take the bytes its format stores them in."""
        from tpu_executor.worker.checkpoint_formats import checkpoint_scheme

        scheme = checkpoint_scheme(hf)
        heads = hf.num_attention_heads
        experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 1
        intermediate = (getattr(hf, "moe_intermediate_size", None) if experts > 1 else None) or hf.intermediate_size
        return cls(layers=hf.num_hidden_layers, hidden=hf.hidden_size, intermediate=intermediate,
                   heads=heads, kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                   head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads, vocab=hf.vocab_size,
                   experts=experts, experts_per_token=getattr(hf, "num_experts_per_tok", 1) or 1,
                   checkpoint_weight_bytes=None if scheme is None else scheme.layout.bytes_per_weight())

    @property
    def attention_params(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def layer_params(self) -> int:
        """The decoder layers' linear parameters (what quantization shrinks)."""
        return self.layers * (self.attention_params + self.experts * self.expert_params)

    def weight_params(self) -> int:
        """Every parameter: layers, embedding and LM head (counted apart: untied or not, the
        head is read each step)."""
        return self.layer_params() + 2 * self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int) -> float:
        """K and V of one token on one chip (KV heads split over ranks, replicated past them)."""
        kv_heads = max(1, self.kv_heads // tp) if tp <= self.kv_heads else 1
        return 2 * self.layers * kv_heads * self.head_dim * dtype_bytes


def linear_bytes_per_weight(quantization: Optional[str], dtype_bytes: float = 2) -> float:
    """Bytes a decoder layer's linear weight takes per parameter: the dtype's; INT8 a byte (its
    channel's scale is a few bytes per thousands of weights); INT4 half a byte plus an fp32 scale
    per group of 128 inputs."""
    return {None: dtype_bytes, "int8": 1.0, "w8a8": 1.0, "int4": 0.5 + 4 / 128}[quantization]


@dataclass(frozen=True)
class CostModel:
    """Roofline time of each graph of a model on a target (a TPU slice or a measured CPU)."""

    model: ModelShape
    chip: Chip
    tp: int
    weight_bytes: float = 2  # per layer parameter: 2 bf16, 4 fp32, quantized: ``linear_bytes_per_weight``
    act_bytes: int = 2
    head_bytes: float = 2  # per embedding and LM-head parameter (never quantized)
    max_logit_rows: int = 8  # a prefill call computes logits for its packed prompts only

    def _expert_fraction(self, tokens: int) -> float:
        """Share of the expert weights a call of ``tokens`` tokens reads (MoE routing)."""
        m = self.model
        return min(1.0, tokens * m.experts_per_token / m.experts) if m.experts > 1 else 1.0

    def _layer_weight_bytes(self, tokens: int) -> float:
        m = self.model
        params = m.attention_params + m.experts * m.expert_params * self._expert_fraction(tokens)
        return m.layers * params * self.weight_bytes / self.tp

    def _linear_flops(self, tokens: int, logit_rows: int) -> float:
        m = self.model
        per_token = m.layers * (m.attention_params + m.experts_per_token * m.expert_params)
        return 2.0 * (per_token * tokens + m.vocab * m.hidden * logit_rows) / self.tp

    def _attention_flops(self, queries: int, keys: float) -> float:
        m = self.model
        return 4.0 * m.layers * m.heads * m.head_dim * queries * keys / self.tp

    def _all_reduce_s(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        payload = tokens * self.model.hidden * self.act_bytes
        one_way = self.chip.ici_bytes_per_s / 2
        per_call = 2 * (self.tp - 1) / self.tp * payload / one_way + ALL_REDUCE_LATENCY_S
        return 2 * self.model.layers * per_call

    def _roofline(self, flops: float, bytes_moved: float, tokens: int) -> float:
        return max(flops / self.chip.peak_flops, bytes_moved / self.chip.hbm_bytes_per_s) + self._all_reduce_s(tokens)

    def prefill_seconds(self, graph: PrefillGraph) -> float:
        """A packed prefill of ``num_tokens`` tokens over ``keys`` keys, attention as one causal
        prompt ending at the last key (an upper bound: packed prompts attend only within
        themselves)."""
        t = graph.num_tokens
        flops = self._linear_flops(t, self.max_logit_rows) + self._attention_flops(t, graph.keys - t / 2)
        head = self.model.vocab * self.model.hidden * self.head_bytes / self.tp
        moved = self._layer_weight_bytes(t) + head + t * self.model.kv_bytes_per_token(self.act_bytes, self.tp)
        return self._roofline(flops, moved, t)

    def decode_seconds(self, graph: DecodeGraph, block_size: int, context_tokens: Optional[float] = None) -> float:
        """A decode of ``num_rows`` sequences, each reading ``context_tokens`` of KV once
        (default: the full width of the graph, as the reference attention does) for each of
        its ``queries`` tokens (a verify graph's k + 1)."""
        rows, tokens = graph.num_rows, graph.num_tokens
        keys = context_tokens if context_tokens is not None else graph.context_blocks * block_size
        flops = self._linear_flops(tokens, tokens) + self._attention_flops(tokens, keys)
        head = self.model.vocab * self.model.hidden * self.head_bytes / self.tp
        moved = (self._layer_weight_bytes(tokens) + head
                 + rows * keys * self.model.kv_bytes_per_token(self.act_bytes, self.tp))
        return self._roofline(flops, moved, tokens)


@dataclass(frozen=True)
class HbmFit:
    """Per-chip memory of a serving configuration against the chip's HBM."""

    weight_bytes: float
    kv_bytes: float
    activation_bytes: float
    hbm_bytes: float
    usable_bytes: float
    max_kv_blocks: int

    @property
    def fits(self) -> bool:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes <= self.usable_bytes


def hbm_fit(cost: CostModel, max_num_seqs: int, max_model_len: int, max_prefill_tokens: int,
            block_size: int, memory_utilization: float = 0.9) -> HbmFit:
    """Weights + a KV cache for ``max_num_seqs`` full-length sequences + the largest prefill's
    activations (about 4 hidden-wide and 2 MLP-wide tensors live at once) on one chip."""
    m = cost.model
    weights = (m.layer_params() * cost.weight_bytes + 2 * m.vocab * m.hidden * cost.head_bytes) / cost.tp
    per_token = m.kv_bytes_per_token(cost.act_bytes, cost.tp)
    kv = max_num_seqs * max_model_len * per_token
    activations = max_prefill_tokens * (4 * m.hidden + 2 * m.intermediate / cost.tp) * cost.act_bytes
    usable = cost.chip.hbm_bytes * memory_utilization
    blocks = int(max(0.0, usable - weights - activations) // (per_token * block_size))
    return HbmFit(weights, kv, activations, cost.chip.hbm_bytes, usable, blocks)
