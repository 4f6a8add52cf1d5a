"""Build random-weight checkpoints of every supported architecture with a freshly trained tokenizer.

Used by the tests (tiny models) and ``tpu-executor bench`` (a ~100M-parameter Gemma-shaped
model); ``python -m scripts.random_checkpoint DIR --arch gemma --size 100m`` writes one.
Weights are drawn with std 1/sqrt(fan_in) and the residual writers are scaled up, so the
models produce peaked, input-dependent distributions; with the default init a random model
repeats one token and a parity check against it would prove nothing.
"""
from __future__ import annotations

import argparse
import os
import random
from typing import Dict, Optional

import torch

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
_SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "el", "or", "is"]

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
FINAL_NORM_SCALE = 3.0
MIXTRAL_EXPERTS = 8
MIXTRAL_SMALL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
GEMMA_100M = dict(vocab_size=8192, hidden_size=768, intermediate_size=3072, num_hidden_layers=11,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=96, max_position_embeddings=1024)


def _corpus(num_lines: int, seed: int, num_words: int):
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(num_words)]
    for _ in range(num_lines):
        yield " ".join(rng.choice(words) for _ in range(rng.randint(4, 16))) + "."


# ChatML, so the chat endpoint can be tested on random checkpoints.
# ChatML with Hermes-style tools (as Qwen writes them): the tools listed in a system turn, an
# assistant's calls as <tool_call> blocks.
CHAT_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
                 "\n</tools><|im_end|>\n{% endif %}"
                 "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
                 "{% for c in m['tool_calls'] or [] %}<tool_call>\n{{ {'name': c['function']['name'], "
                 "'arguments': c['function']['arguments']} | tojson }}\n</tool_call>{% endfor %}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer trained on synthetic text, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # Enough distinct words that BPE reaches the requested vocabulary size.
    tok.train_from_iterator(_corpus(4000, seed, max(400, vocab_size)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=CHAT_TEMPLATE)


ARCHITECTURES = ("llama", "llama3", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2",
                 "gemma3", "gemma3_mm")
# A window shorter than the test prompts, so sliding layers are exercised.
WINDOW = 32


def _config(arch: str, sizes: Dict, vocab_size: int):
    """A transformers config of ``arch`` with ``sizes``: each family's distinguishing features
    switched on (Llama-3's RoPE and tied embeddings, Qwen3's YaRN, Gemma-3's per-type RoPE)."""
    import transformers as tf

    common = dict(sizes, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    untied = dict(common, tie_word_embeddings=False)
    if arch in ("gemma3", "gemma3_mm"):
        return _gemma3_config(arch, dict(common, num_key_value_heads=1))
    configs = {
        "llama": lambda: tf.LlamaConfig(**untied, rope_theta=10000.0),
        "llama3": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=256)),
        "mistral": lambda: tf.MistralConfig(**untied, sliding_window=WINDOW),
        "mixtral": lambda: tf.MixtralConfig(**untied, rope_theta=10000.0, sliding_window=None,
                                            num_local_experts=MIXTRAL_EXPERTS, num_experts_per_tok=2),
        "qwen2": lambda: tf.Qwen2Config(**untied),
        "qwen3": lambda: tf.Qwen3Config(**untied, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512)),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**untied, num_experts=MIXTRAL_EXPERTS, num_experts_per_tok=2,
                                               moe_intermediate_size=sizes["intermediate_size"] // 2,
                                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]),
        "gemma": lambda: tf.GemmaConfig(**common, hidden_act="gelu_pytorch_tanh"),
        "gemma2": lambda: tf.Gemma2Config(**common, sliding_window=WINDOW, query_pre_attn_scalar=sizes["head_dim"],
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    }
    if arch not in configs:
        raise ValueError(f"unknown architecture {arch!r}; use one of {', '.join(ARCHITECTURES)}")
    return configs[arch]()


def _gemma3_config(arch: str, common: Dict):
    """Gemma-3 text (a sliding layer, then a global one with linear-scaled RoPE), or the same
    language model inside a multimodal checkpoint with a tiny vision tower."""
    import transformers as tf

    layers = common["num_hidden_layers"]
    text = dict(common, sliding_window=WINDOW, query_pre_attn_scalar=common["head_dim"],
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                 "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})
    if arch == "gemma3":
        return tf.Gemma3TextConfig(**text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8)
    return tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                           boi_token_index=3, eoi_token_index=4, image_token_index=5)


@torch.no_grad()
def _scale_weights(model, residual_gain: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model_type = getattr(model.config, "model_type", "")
    gemma = model_type.startswith("gemma")
    for name, param in model.named_parameters():
        if param.dim() >= 2:  # [out, in] linears and stacked [experts, out, in] expert weights
            std = param.shape[-1] ** -0.5 if "embed" not in name else 1.0
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std *= residual_gain
            if "embed" in name and gemma:
                std = model.config.get_text_config().hidden_size ** -0.5  # Gemma multiplies embeddings by sqrt(hidden)
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        elif "norm" in name:
            scale = _norm_scale(name, model_type, residual_gain)
            # Gemma stores (scale - 1): its norms multiply by (1 + weight).
            param.copy_(scale - (1.0 if gemma else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))


def _norm_scale(name: str, model_type: str, residual_gain: float) -> float:
    """Gemma-2 and 3 normalise each block's output, so the residual gain goes into those norms
    (scaling the residual writers has no effect there); the final norm sharpens the logits so
    greedy picks have clear margins."""
    if name in ("model.norm.weight", "model.language_model.norm.weight"):
        return FINAL_NORM_SCALE
    sandwich = model_type in ("gemma2", "gemma3", "gemma3_text")
    if sandwich and ("post_attention_layernorm" in name or "post_feedforward_layernorm" in name):
        return residual_gain
    return 1.0


# How much the residual writers (or Gemma-2/3's post-norms) are scaled up. With tied
# embeddings (Llama-3's small models) the input token's embedding dominates the residual
# stream and the head maps it back to itself, so the model repeats its input unless the
# layers write more.
RESIDUAL_GAIN = 16.0
TIED_RESIDUAL_GAIN = 32.0


# Sizes the Pallas TPU kernels take (head_dim 128; heads, KV heads and every expert's features
# that split over 8 chips into whole 128-lane tiles),
# small enough to compile for a TPU in seconds: configs for ``tpu-executor compile``.
TPU_TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=2048, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048)


def write_config(out_dir: str, arch: str = "llama", sizes: Dict = TPU_TINY) -> str:
    """Write only the config.json of ``arch`` with ``sizes`` (no weights, no tokenizer): all
    that compiling for a TPU reads."""
    from transformers.models.auto import modeling_auto

    config = _config(arch, sizes, sizes["vocab_size"])
    names = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES if arch == "gemma3_mm"
             else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    config.architectures = [names[config.model_type]]
    os.makedirs(out_dir, exist_ok=True)
    config.to_json_file(os.path.join(out_dir, "config.json"))
    return out_dir


def build(out_dir: str, arch: str = "llama", sizes: Dict = TINY, seed: int = 0,
          residual_gain: Optional[float] = None) -> str:
    """Write a random checkpoint of ``arch`` to ``out_dir`` (reused if already there)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    tokenizer = train_tokenizer(sizes["vocab_size"], seed)
    config = _config(arch, sizes, len(tokenizer))
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if arch == "gemma3_mm" else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    if residual_gain is None:
        tied = config.tie_word_embeddings and not arch.startswith("gemma")
        residual_gain = TIED_RESIDUAL_GAIN if tied else RESIDUAL_GAIN
    _scale_weights(model, residual_gain, seed)
    tmp = out_dir + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="checkpoint directory to write")
    parser.add_argument("--arch", default="gemma", choices=ARCHITECTURES)
    parser.add_argument("--size", default="100m", choices=["tiny", "100m", "mixtral-small"])
    args = parser.parse_args(argv)
    sizes = {"tiny": TINY, "100m": GEMMA_100M, "mixtral-small": MIXTRAL_SMALL}[args.size]
    print(build(args.out, args.arch, sizes))

