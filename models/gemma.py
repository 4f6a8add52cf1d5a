"""Gemma: the Llama block with (1 + w) RMSNorm, GeLU-tanh MLP and sqrt(hidden)-scaled embeddings."""
from __future__ import annotations

from tpu_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's block with Gemma's (1 + w) norms and GeLU-tanh MLP."""

    norm_unit_offset = True

    @staticmethod
    def activation_of(cfg) -> str:
        # Gemma checkpoints name it hidden_act or hidden_activation; both mean GeLU-tanh.
        return getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"


class GemmaModel(LlamaModel):
    """Gemma's stack: embeddings scaled by sqrt(hidden_size)."""

    def __init__(self, cfg, tp, layer_class, attention_class):
        super().__init__(cfg, tp, layer_class, attention_class)
        self.embed_scale = cfg.hidden_size ** 0.5


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma (v1) causal LM."""

    model_class = GemmaModel
    layer_class = GemmaDecoderLayer
