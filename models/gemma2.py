"""Gemma-2: Gemma plus sandwich norms, attention and final logit soft-capping, and
sliding-window attention on the layers ``layer_types`` marks as ``sliding_attention``
(``LlamaAttention`` reads the window)."""
from __future__ import annotations

import torch

from tpu_executor.models.gemma import GemmaDecoderLayer, GemmaForCausalLM
from tpu_executor.models.layers.norm import RMSNorm


class Gemma2DecoderLayer(GemmaDecoderLayer):
    """Norms before and after both the attention and the MLP."""

    def __init__(self, cfg, layer_idx: int, tp, attention_class):
        super().__init__(cfg, layer_idx, tp, attention_class)
        eps = cfg.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, unit_offset=True)
        attn = self.self_attn
        attn.scale = cfg.query_pre_attn_scalar ** -0.5
        attn.soft_cap = getattr(cfg, "attn_logit_softcapping", None)

    def forward(self, x: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        attended = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache, meta))
        normed, x = self.pre_feedforward_layernorm(attended, residual=x)
        return x + self.post_feedforward_layernorm(self.mlp(normed, meta.lora_slots))


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma-2 causal LM (final logits soft-capped)."""

    layer_class = Gemma2DecoderLayer

    def __init__(self, cfg, tp=None):
        super().__init__(cfg, tp)
        self.final_logit_softcap = getattr(cfg, "final_logit_softcapping", None)
