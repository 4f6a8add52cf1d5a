"""Shared test helpers: engine options for tiny models, prompts, transformers references."""
from __future__ import annotations

import random
from typing import List, Tuple

import torch


def mixed_prompts(count: int, low: int, high: int, vocab: int, seed: int = 0) -> List[List[int]]:
    """``count`` prompts of random ids, lengths spread over [low, high] (both ends included)."""
    rng = random.Random(seed)
    lengths = [low, high] + [rng.randint(low, high) for _ in range(count - 2)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@torch.no_grad()
def hf_greedy(path: str, prompts: List[List[int]], max_new_tokens: int) -> Tuple[List[List[int]], List[torch.Tensor]]:
    """Greedy tokens and per-step log-softmax of the raw logits ``[steps, vocab]`` per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens, logprobs = [], []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        tokens.append(out.sequences[0, len(prompt):].tolist())
        logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return tokens, logprobs


def tiny_engine_options(**overrides):
    """Small buckets so tiny-model engines compile in seconds."""
    options = dict(max_model_len=320, max_num_seqs=8, prefill_buckets=(32, 128, 320),
                   decode_buckets=(2, 8), decode_context_buckets=(128, 320), cache_dir=None,
                   show_progress=False)
    options.update(overrides)
    return options
