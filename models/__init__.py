"""Model files, one per family, selected by the ``architectures`` entry of a checkpoint's config.json."""
from __future__ import annotations

from tpu_executor.models.gemma import GemmaForCausalLM
from tpu_executor.models.gemma2 import Gemma2ForCausalLM
from tpu_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tpu_executor.models.llama import LlamaForCausalLM
from tpu_executor.models.mistral import MistralForCausalLM
from tpu_executor.models.mixtral import MixtralForCausalLM
from tpu_executor.models.qwen2 import Qwen2ForCausalLM
from tpu_executor.models.qwen3 import Qwen3ForCausalLM
from tpu_executor.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {cls.__name__: cls for cls in (
    LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM,
    Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)}


def model_class_for(architectures) -> type:
    """The model class for a checkpoint, or a ValueError listing what is supported."""
    for name in architectures or ():
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(f"unsupported architecture {architectures!r}; supported: {sorted(MODEL_REGISTRY)}")


__all__ = ["MODEL_REGISTRY", "model_class_for", *sorted(MODEL_REGISTRY)]
