"""Mixtral: the Llama decoder with a sparse mixture-of-experts block in place of the MLP.

The block (``block_sparse_moe`` in checkpoints) routes each token to its top-k experts
(softmax over the router logits, top-k, renormalised) and runs them as grouped matmuls
(``models/layers/moe.py``). Expert tensors ``experts.{e}.w1/w3/w2`` load into stacked
weights; the router is replicated on every rank.
"""
from __future__ import annotations

import re
from typing import Tuple

from torch import nn

from tpu_executor.kernels.act_and_mul.reference import ACTIVATIONS
from tpu_executor.models.layers.moe import SparseMoeBlock, expert_target
from tpu_executor.models.layers.parallel import TensorParallelGroup
from tpu_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_EXPERT_TENSOR = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's block with the mixture of experts as its feed-forward."""

    def build_mlp(self, cfg, layer_idx: int, tp: TensorParallelGroup) -> nn.Module:
        return SparseMoeBlock(cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, cfg.num_experts_per_tok,
                              ACTIVATIONS[getattr(cfg, "hidden_act", "silu")], tp)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral causal LM (Mixtral-8x7B layout)."""

    layer_class = MixtralDecoderLayer

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        """Expert ``e``'s w1/w3 go to ``(e, 0)``/``(e, 1)`` of ``experts.w13``, w2 to shard ``e``
        of ``experts.w2``; ``block_sparse_moe`` is our layers' ``mlp``."""
        return expert_target(name, _EXPERT_TENSOR, "w1", "w3") or \
            super().checkpoint_target(name.replace(".block_sparse_moe.", ".mlp."))
