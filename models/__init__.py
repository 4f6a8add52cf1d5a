"""Model files, selected by the ``architectures`` entry of a checkpoint's config.json."""
from __future__ import annotations

from tpu_executor.models.gemma import GemmaForCausalLM
from tpu_executor.models.gemma2 import Gemma2ForCausalLM
from tpu_executor.models.llama import LlamaForCausalLM
from tpu_executor.models.mixtral import MixtralForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def model_class_for(architectures) -> type:
    """The model class for a checkpoint, or a ValueError listing what is supported."""
    for name in architectures or ():
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {sorted(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "model_class_for", "LlamaForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "MixtralForCausalLM"]
