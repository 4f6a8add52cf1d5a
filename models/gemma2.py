"""Gemma-2: Gemma plus sandwich norms, attention and final logit soft-capping, and
sliding-window attention on the layers ``layer_types`` marks as ``sliding_attention``."""
from __future__ import annotations

import torch

from tpu_executor.models.gemma import GemmaDecoderLayer, GemmaForCausalLM, GemmaModel
from tpu_executor.models.layers.norm import RMSNorm


def sliding_layers(cfg) -> list:
    """Which layers use the sliding window (older configs alternate, starting with layer 0)."""
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        return [i % 2 == 0 for i in range(cfg.num_hidden_layers)]
    return [t == "sliding_attention" for t in layer_types]


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Norms before and after both the attention and the MLP."""

    def __init__(self, cfg, layer_idx: int, tp):
        super().__init__(cfg, layer_idx, tp)
        eps = cfg.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        attn = self.self_attn
        attn.scale = cfg.query_pre_attn_scalar ** -0.5
        attn.soft_cap = getattr(cfg, "attn_logit_softcapping", None)
        if sliding_layers(cfg)[layer_idx]:
            attn.sliding_window = cfg.sliding_window

    def forward(self, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2Model(GemmaModel):
    """Gemma's stack with Gemma-2 blocks."""

    layer_class = Gemma2DecoderLayer


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma-2 causal LM (final logits soft-capped)."""

    model_class = Gemma2Model

    def __init__(self, cfg, tp=None):
        super().__init__(cfg, tp)
        self.final_logit_softcap = getattr(cfg, "final_logit_softcapping", None)
