"""Mistral: the Llama block with a sliding window on every layer (``sliding_window``, read by
``LlamaAttention`` for configs without ``layer_types``)."""
from __future__ import annotations

from tpu_executor.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral causal LM (Mistral-7B layout)."""
