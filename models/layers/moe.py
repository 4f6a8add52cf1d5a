"""Sparse mixture of experts (Mixtral): softmax router, top-k, renormalised weights, and the
experts as two grouped matmuls over the tokens sorted by expert.

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

from typing import Callable, Tuple

import torch
from torch import nn

from tpu_executor.models.layers.linear import copy_from_hf, narrow_checked, quantize_parameter
from tpu_executor.models.layers.parallel import TensorParallelGroup, divide
from tpu_executor.kernels.gmm.ops import gmm, padded_rows
from tpu_executor.kernels.w8a16_matmul.reference import dequantize


def route(router_logits: torch.Tensor, top_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32 summing to 1 per token, expert ids ``[T, k]``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def moe_reference(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  top_k: int, act: Callable) -> torch.Tensor:
    """Every expert on every token, weighted by the routing (zero for unchosen experts).

    x ``[T, H]``, w13 ``[E, H, 2I]`` (gate then up), w2 ``[E, I, H]`` -> ``[T, H]``.
    """
    weights, experts = route(router_logits, top_k)
    combine = torch.zeros(x.shape[0], w13.shape[0], device=x.device).scatter_add(1, experts, weights)
    gate, up = torch.einsum("th,ehi->eti", x, w13).chunk(2, dim=-1)
    out = torch.einsum("eti,eih->eth", act(gate) * up, w2)
    return torch.einsum("eth,te->th", out, combine.to(x.dtype))


def sparse_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               top_k: int, act: Callable) -> torch.Tensor:
    """The same result as ``moe_reference`` with only the chosen experts' work (see module doc)."""
    num_tokens, num_experts = x.shape[0], w13.shape[0]
    weights, experts = route(router_logits, top_k)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, tokens in order within
    token_of_row = order // top_k
    group_sizes = torch.zeros(num_experts, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    rows = num_tokens * top_k
    # Pad rows to the kernel's row tile; padding rows lie past the last group and come back zero.
    lhs = torch.nn.functional.pad(x[token_of_row], (0, 0, 0, padded_rows(rows, x.dtype) - rows))
    gate, up = gmm(lhs, w13, group_sizes).chunk(2, dim=-1)
    out = gmm(act(gate) * up, w2, group_sizes)[:rows]
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

    def _load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        expert, which = shard_id
        rows = narrow_checked(loaded, 0, self.tp.rank * self.local, self.local, self.intermediate_size)
        copy_from_hf(param[expert].narrow(-1, which * self.local, self.local), rows)

    def _load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        columns = narrow_checked(loaded, 1, self.tp.rank * self.local, self.local, self.intermediate_size)
        copy_from_hf(param[shard_id], columns)

    def quantize_int8(self) -> None:
        """INT8 experts with one scale per (expert, output channel)."""
        quantize_parameter(self, "w13")
        quantize_parameter(self, "w2")

    def weights(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in ``dtype``: dequantized on the fly when stored as INT8."""
        if "w13_q" in self._parameters:
            return (dequantize(self.w13_q, self.w13_scale, dtype), dequantize(self.w2_q, self.w2_scale, dtype))
        return self.w13, self.w2
