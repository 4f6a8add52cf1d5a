"""Published configs (config.json on the Hugging Face hub, the fields the engine reads) of
models a user may size or compile a TPU job for without the weights here: ``tpu-executor tune
--model NAME`` and ``tpu-executor compile NAME`` need only their shapes."""
from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator

_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=8, vocab_size=128256,
               rms_norm_eps=1e-5)
_QWEN3 = dict(model_type="qwen3", head_dim=128, vocab_size=151936, max_position_embeddings=40960,
              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)

MODEL_SHAPES: Dict[str, Dict[str, Any]] = {
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, max_position_embeddings=8192, rope_theta=500000.0),
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE),
    "llama-3.3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, max_position_embeddings=131072, rope_scaling=_LLAMA3_ROPE),
    "qwen3-8b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
    "qwen3-32b": dict(_QWEN3, architectures=["Qwen3ForCausalLM"], hidden_size=5120, intermediate_size=25600,
                      num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8),
    "qwen3-30b-a3b": dict(_QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
    "gemma-7b": dict(architectures=["GemmaForCausalLM"], model_type="gemma", hidden_size=3072,
                     intermediate_size=24576, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=16, head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                     rms_norm_eps=1e-6),
    # The language model of gemma-3-27b-it (a multimodal checkpoint; its text config).
    "gemma-3-27b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=5376,
                        intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
                        num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168, sliding_window=1024,
                        vocab_size=262208, max_position_embeddings=131072, rms_norm_eps=1e-6,
                        rope_scaling=dict(rope_type="linear", factor=8.0), rope_theta=1000000.0,
                        rope_local_base_freq=10000.0),
}


@contextmanager
def model_directory(model: str) -> Iterator[str]:
    """A checkpoint directory for ``model``: the directory itself, or a temporary one holding
    only the config.json of a name in ``MODEL_SHAPES``."""
    if os.path.isdir(model):
        yield model
        return
    if model not in MODEL_SHAPES:
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor one of {sorted(MODEL_SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="tpu-executor-shape-") as path:
        with open(os.path.join(path, "config.json"), "w") as handle:
            json.dump(MODEL_SHAPES[model], handle)
        yield path
