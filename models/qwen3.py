"""Qwen3: Llama's block with a per-head RMSNorm on q and k before RoPE (``q_norm``,
``k_norm``); biases follow ``attention_bias`` (off in the published checkpoints)."""
from __future__ import annotations

from tpu_executor.models.layers.norm import RMSNorm
from tpu_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def qk_norms(self, cfg):
        return RMSNorm(self.head_dim, cfg.rms_norm_eps), RMSNorm(self.head_dim, cfg.rms_norm_eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 causal LM."""

    attention_class = Qwen3Attention
