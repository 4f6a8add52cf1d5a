"""Qwen2 / Qwen2.5: Llama's block with biases on the q, k and v projections (the output
projection has none). Sliding windows, where a config turns them on, come from its
``layer_types`` like every family's (``LlamaAttention``)."""
from __future__ import annotations

from typing import Tuple

from tpu_executor.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def biases(cfg) -> Tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM."""

    attention_class = Qwen2Attention
