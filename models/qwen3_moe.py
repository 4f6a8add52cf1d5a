"""Qwen3-MoE: Qwen3's attention with a sparse mixture of experts as the feed-forward of every
layer ``decoder_sparse_step`` marks (a dense MLP on ``mlp_only_layers``): ``num_experts``
experts of ``moe_intermediate_size``, top ``num_experts_per_tok``, the chosen weights
renormalised when ``norm_topk_prob`` says so. The experts run through the same grouped
matmuls as Mixtral's (``models/layers/moe.py``); checkpoint tensors
``mlp.experts.{e}.gate_proj/up_proj/down_proj`` load into the stacked weights.
"""
from __future__ import annotations

import re
from typing import Tuple

from torch import nn

from tpu_executor.kernels.act_and_mul.reference import ACTIVATIONS
from tpu_executor.models.layers.moe import SparseMoeBlock, expert_target
from tpu_executor.models.layers.parallel import TensorParallelGroup
from tpu_executor.models.llama import LlamaDecoderLayer
from tpu_executor.models.qwen3 import Qwen3ForCausalLM

_EXPERT_TENSOR = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def is_sparse_layer(cfg, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (as transformers decides it)."""
    return (layer_idx not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer_idx + 1) % cfg.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        if not is_sparse_layer(cfg, layer_idx):
            return super().build_mlp(cfg, layer_idx, tp)
        return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                              ACTIVATIONS[self.activation_of(cfg)], tp, normalize=bool(cfg.norm_topk_prob))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE causal LM (Qwen3-30B-A3B layout)."""

    layer_class = Qwen3MoeDecoderLayer

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        return expert_target(name, _EXPERT_TENSOR, "gate_proj", "up_proj") or super().checkpoint_target(name)
