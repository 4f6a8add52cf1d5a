"""Build random-weight checkpoints (Llama, Gemma, Gemma-2, Mixtral) with a freshly trained tokenizer.

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
from typing import Dict

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
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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


def _config(arch: str, sizes: Dict, vocab_size: int):
    from transformers import Gemma2Config, GemmaConfig, LlamaConfig, MixtralConfig

    common = dict(sizes, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "gemma":
        return GemmaConfig(**common, hidden_act="gelu_pytorch_tanh")
    if arch == "gemma2":
        return Gemma2Config(**common, sliding_window=32, query_pre_attn_scalar=sizes["head_dim"],
                            attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if arch == "mixtral":
        return MixtralConfig(**common, tie_word_embeddings=False, rope_theta=10000.0, sliding_window=None,
                             num_local_experts=MIXTRAL_EXPERTS, num_experts_per_tok=2)
    raise ValueError(f"unknown architecture {arch!r}; use llama, gemma, gemma2 or mixtral")


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
                std = model.config.hidden_size ** -0.5  # Gemma multiplies embeddings by sqrt(hidden)
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        elif "norm" in name:
            scale = _norm_scale(name, model_type, residual_gain)
            # Gemma stores (scale - 1): its norms multiply by (1 + weight).
            param.copy_(scale - (1.0 if gemma else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))


def _norm_scale(name: str, model_type: str, residual_gain: float) -> float:
    """Gemma-2 normalises each block's output, so the residual gain goes into those norms; the
    final norm sharpens the logits so greedy picks have clear margins."""
    if name == "model.norm.weight":
        return FINAL_NORM_SCALE
    if model_type == "gemma2" and ("post_attention_layernorm" in name or "post_feedforward_layernorm" in name):
        return residual_gain
    return 1.0


def build(out_dir: str, arch: str = "llama", sizes: Dict = TINY, seed: int = 0,
          residual_gain: float = 16.0) -> str:
    """Write a random checkpoint of ``arch`` to ``out_dir`` (reused if already there)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    from transformers import AutoModelForCausalLM

    tokenizer = train_tokenizer(sizes["vocab_size"], seed)
    config = _config(arch, sizes, len(tokenizer))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _scale_weights(model, residual_gain, seed)
    tmp = out_dir + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="checkpoint directory to write")
    parser.add_argument("--arch", default="gemma", choices=["llama", "gemma", "gemma2", "mixtral"])
    parser.add_argument("--size", default="100m", choices=["tiny", "100m", "mixtral-small"])
    args = parser.parse_args(argv)
    sizes = {"tiny": TINY, "100m": GEMMA_100M, "mixtral-small": MIXTRAL_SMALL}[args.size]
    print(build(args.out, args.arch, sizes))

