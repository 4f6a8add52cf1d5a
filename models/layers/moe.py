"""Sparse mixture of experts (Mixtral, Qwen3-MoE): softmax router, top-k, weights renormalised
(or not), and the experts as two grouped matmuls over the tokens sorted by expert.

``sparse_moe`` is the serving path: every (token, choice) pair becomes one row, rows are
sorted by expert, the group sizes are counted on the device with fixed shapes, and
``gmm`` (our Pallas kernel on TPU, its torch reference elsewhere) runs the fused gate/up
projection and then the down projection; the weighted rows are added back to their tokens.
``moe_reference`` is THE spec: every expert on every token by einsum, combined with the
routing weights. Expert weights are stacked ``[experts, in, out]``; with tensor
parallelism each rank holds a slice of the intermediate dimension of every expert and the
block's output is all-reduced.
"""
from __future__ import annotations

import re
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from tpu_executor.kernels.gmm.ops import gmm, padded_rows
from tpu_executor.kernels.w8a16_matmul.reference import dequantize
from tpu_executor.models.layers.linear import ColumnParallelLinear, Placement, quantize_parameter
from tpu_executor.models.layers.parallel import SingleRank, TensorParallelGroup, divide


def route(router_logits: torch.Tensor, top_k: int, normalize: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert ids ``[T, k]``): the top-k of the softmax, renormalised
    to sum to 1 per token unless ``normalize`` is off (Qwen3-MoE's ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), experts


def moe_reference(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_k: int, act: Callable, normalize: bool = True) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero for unchosen experts).

    x ``[T, H]``, w13 ``[E, H, 2I]`` (gate then up), w2 ``[E, I, H]`` -> ``[T, H]``.
    """
    weights, experts = route(router_logits, top_k, normalize)
    combine = torch.zeros(x.shape[0], w13.shape[0], device=x.device).scatter_add(1, experts, weights)
    gate, up = torch.einsum("th,ehi->eti", x, w13).chunk(2, dim=-1)
    out = torch.einsum("eti,eih->eth", act(gate) * up, w2)
    return torch.einsum("eth,te->th", out, combine.to(x.dtype))


def sparse_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               top_k: int, act: Callable, normalize: bool = True,
               side: Tuple[Tuple, Tuple] = ((), ())) -> torch.Tensor:
    """The same result as ``moe_reference`` with only the chosen experts' work (see module doc).
    ``side``: w13's and w2's scales (and zeros) when they are quantized (``gmm``'s)."""
    num_tokens, num_experts = x.shape[0], w13.shape[0]
    weights, experts = route(router_logits, top_k, normalize)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens in order within
    token_of_row = order // top_k
    group_sizes = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    rows = num_tokens * top_k
    # Pad rows to the kernel's row tile; padding rows lie past the last group and come back zero.
    lhs = torch.nn.functional.pad(x[token_of_row], (0, 0, 0, padded_rows(rows, x.dtype) - rows))
    # Megatron's split: gate/up by their output features, down by its input features.
    gate, up = gmm(lhs, w13, group_sizes, *side[0], tp_split="columns").chunk(2, dim=-1)
    # Packed INT4 bytes hold inputs half of k apart: a mesh splits those weights by outputs.
    down_split = "columns" if w2.shape[1] * 2 == gate.shape[-1] else "rows"
    out = gmm(act(gate) * up, w2, group_sizes, *side[1], tp_split=down_split)[:rows]
    out = out * weights.reshape(-1)[order].to(out.dtype)[:, None]
    return torch.zeros_like(x).index_add(0, token_of_row, out)


class ExpertWeights(nn.Module):
    """Stacked expert weights: ``w13 [E, H, 2I/tp]`` (this rank's gate slice, then its up
    slice) and ``w2 [E, I/tp, H]``. Checkpoint tensors ``experts.{e}.w1/w3/w2`` (Hugging Face
    ``[out, in]``) load into expert ``e`` as shards ``(e, 0)``, ``(e, 1)`` and ``e``."""

    quantizable = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.intermediate_size = intermediate_size
        self.local = divide(intermediate_size, tp.world_size, "intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * self.local))
        self.w2 = nn.Parameter(torch.empty(num_experts, self.local, hidden_size))
        self.w13.weight_loader, self.w13.shard_ids = self._load_w13, tuple(
            (e, j) for e in range(num_experts) for j in (0, 1))
        self.w2.weight_loader, self.w2.shard_ids = self._load_w2, tuple(range(num_experts))

    def placement(self, name: str, shard_id) -> Placement:
        """Where expert tensor ``shard_id`` of ``name`` goes: gate/up (``w13``, shard ``(e, 0|1)``)
        by their rows, down (``w2``, shard ``e``) by its columns of this rank's slice."""
        start = self.tp.rank * self.local
        if name == "w13":
            expert, which = shard_id
            return Placement(0, start, self.local, self.intermediate_size, expert, which * self.local, self.local)
        return Placement(1, start, self.local, self.intermediate_size, shard_id)

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        self.placement("w13", shard_id).copy(param, loaded)

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        self.placement("w2", shard_id).copy(param, loaded)

    def quantize(self, scheme: str) -> None:
        """Quantized experts (``quantize_parameter``'s schemes, per expert)."""
        quantize_parameter(self, "w13", scheme)
        quantize_parameter(self, "w2", scheme)

    def weights(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor, Tuple]:
        """(w13, w2, each one's side tensors) for ``sparse_moe``: quantized experts as they are
        stored, with their scales (INT4: and zeros), for the grouped matmul to read; group-wise
        INT8 dequantized to ``dtype`` on the fly."""
        if "w13_q" in self._parameters and self.w13_scale.dim() == 2 and self.w2_scale.dim() == 2:
            return self.w13_q, self.w2_q, ((self.w13_scale,), (self.w2_scale,))
        if "w13_q" in self._parameters:
            return (dequantize(self.w13_q, self.w13_scale, dtype), dequantize(self.w2_q, self.w2_scale, dtype),
                    ((), ()))
        if "w13_q4" in self._parameters:
            return self.w13_q4, self.w2_q4, tuple((getattr(self, f"{w}_scale"), self._parameters.get(f"{w}_zero"))
                                                  for w in ("w13", "w2"))
        return self.w13, self.w2, ((), ())


class SparseMoeBlock(nn.Module):
    """Router (``gate``, replicated on every rank) + ``experts``; the output, partial over this
    rank's intermediate slice, is all-reduced."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, act: Callable,
                 tp: TensorParallelGroup, normalize: bool = True):
        super().__init__()
        self.tp, self.top_k, self.act, self.normalize = tp, top_k, act, normalize
        self.gate = ColumnParallelLinear(hidden_size, num_experts, SingleRank())
        self.gate.quantizable = False  # tiny, and routing decisions are sensitive to it
        self.experts = ExpertWeights(num_experts, hidden_size, intermediate_size, tp)

    def forward(self, x: torch.Tensor, lora_slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``lora_slots``: adapters do not reach the experts (refused when an adapter targets them)."""
        w13, w2, side = self.experts.weights(x.dtype)
        return self.tp.all_reduce(sparse_moe(x, self.gate(x), w13, w2, self.top_k, self.act, self.normalize, side))


def expert_target(name: str, pattern: "re.Pattern", gate: str, up: str) -> Optional[Tuple[str, object]]:
    """(parameter, shard) for a per-expert checkpoint tensor matched by ``pattern`` (groups:
    layer prefix, expert, projection), or None: the ``gate`` and ``up`` projections of expert
    ``e`` go to ``(e, 0)`` and ``(e, 1)`` of ``mlp.experts.w13``, the third to shard ``e`` of
    ``mlp.experts.w2``."""
    match = pattern.match(name)
    if match is None:
        return None
    prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
    if which not in (gate, up):
        return f"{prefix}.mlp.experts.w2", expert
    return f"{prefix}.mlp.experts.w13", (expert, 0 if which == gate else 1)
