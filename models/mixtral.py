"""Mixtral: the Llama decoder with a sparse mixture-of-experts block in place of the MLP.

The block (``block_sparse_moe`` in checkpoints) routes each token to its top-k experts
(softmax over the router logits, top-k, renormalised) and runs them as grouped matmuls
(``models/layers/moe.py``). Expert tensors ``experts.{e}.w1/w3/w2`` load into stacked
weights; the router is replicated on every rank.
"""
from __future__ import annotations

import re
from typing import Tuple

import torch
from torch import nn

from tpu_executor.models.layers.linear import ColumnParallelLinear
from tpu_executor.models.layers.moe import ExpertWeights, sparse_moe
from tpu_executor.models.layers.parallel import SingleRank, TensorParallelGroup
from tpu_executor.models.llama import ACTIVATIONS, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

_EXPERT_TENSOR = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class MixtralMoE(nn.Module):
    """Router + experts; the output (partial over this rank's intermediate slice) is all-reduced."""

    def __init__(self, cfg, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        self.act = ACTIVATIONS[getattr(cfg, "hidden_act", "silu")]
        self.gate = ColumnParallelLinear(cfg.hidden_size, cfg.num_local_experts, SingleRank())
        self.gate.quantizable = False  # tiny, and routing decisions are sensitive to it
        self.experts = ExpertWeights(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.experts.weights(x.dtype)
        return self.tp.all_reduce(sparse_moe(x, self.gate(x), w13, w2, self.top_k, self.act))


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's block with the mixture of experts as its feed-forward."""

    def build_mlp(self, cfg, tp: TensorParallelGroup) -> nn.Module:
        return MixtralMoE(cfg, tp)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM (Mixtral-8x7B layout)."""

    model_class = MixtralModel

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        """Expert ``e``'s w1/w3 go to ``(e, 0)``/``(e, 1)`` of ``experts.w13``, w2 to shard ``e``
        of ``experts.w2``; ``block_sparse_moe`` is our layers' ``mlp``."""
        match = _EXPERT_TENSOR.match(name)
        if match:
            prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
            if which == "w2":
                return f"{prefix}.mlp.experts.w2", expert
            return f"{prefix}.mlp.experts.w13", (expert, 0 if which == "w1" else 1)
        return super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))
