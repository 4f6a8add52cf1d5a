"""Gemma-3: Gemma-2's block (sandwich norms, ``query_pre_attn_scalar``, soft-caps where the
config sets them) with Gemma's ``(1 + w)`` RMSNorm on each head's q and k, and sliding-window
layers in a local:global pattern (``layer_types``), each type with its own RoPE parameters
(the local base frequency on sliding layers). A multimodal checkpoint
(``Gemma3ForConditionalGeneration``) serves text: its language model loads, its vision tower
and projector are skipped.
"""
from __future__ import annotations

from typing import Tuple

from tpu_executor.models.gemma2 import Gemma2ForCausalLM
from tpu_executor.models.layers.norm import RMSNorm
from tpu_executor.models.llama import LlamaAttention

# Where a multimodal checkpoint keeps its language model (transformers 5, then earlier saves).
_LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3Attention(LlamaAttention):
    def qk_norms(self, cfg):
        eps = cfg.rms_norm_eps
        return RMSNorm(self.head_dim, eps, unit_offset=True), RMSNorm(self.head_dim, eps, unit_offset=True)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma-3 causal LM (the text-only checkpoints, ``gemma-3-1b`` and the like)."""

    attention_class = Gemma3Attention


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma-3 checkpoint (``gemma-3-4b-it`` and up);
    built from its text config (``load_hf_config`` hands that out)."""

    def skips_checkpoint_tensor(self, name: str) -> bool:
        return name.startswith(_NOT_TEXT)

    def checkpoint_target(self, name: str) -> Tuple[str, object]:
        for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return super().checkpoint_target(ours + name[len(prefix):])
        return super().checkpoint_target(name)
