"""Write a random-weight EAGLE-3 head for a target checkpoint, in the layout the published
heads use (vLLM's ``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``
over a draft vocabulary, ``d2t``/``t2d``).

No trained head can be had here: a random one proves that speculation with a head changes no
output and that the layout loads, not that drafts are accepted.
``python -m tpu_executor.tools.eagle3_head TARGET OUT [--draft-vocab-size N]``.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Optional, Sequence

import torch


def head_tensors(cfg: Dict, draft_vocab_size: int, seed: int) -> Dict[str, torch.Tensor]:
    """Random head tensors for a head config ``cfg`` (std 1/sqrt(fan_in)); the draft vocabulary
    is a random subset of the target's (``d2t`` offsets, ``t2d`` mask)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inner = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5

    tensors = {
        "midlayer.self_attn.q_proj.weight": linear(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": linear(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": linear(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": linear(inner, hidden),
        "midlayer.mlp.up_proj.weight": linear(inner, hidden),
        "midlayer.mlp.down_proj.weight": linear(hidden, inner),
        "fc.weight": linear(hidden, 3 * hidden),
        "lm_head.weight": linear(draft_vocab_size, hidden),
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    vocab = cfg["vocab_size"]
    if draft_vocab_size != vocab:
        target_ids = torch.randperm(vocab, generator=gen)[:draft_vocab_size].sort().values
        tensors["d2t"] = target_ids - torch.arange(draft_vocab_size)
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, target_ids, True)
    return tensors


def head_config(target: Dict, draft_vocab_size: int, aux_layer_ids: Optional[Sequence[int]]) -> Dict:
    """An EAGLE-3 head config for a target's config: the target's widths, one layer."""
    layers = target["num_hidden_layers"]
    if aux_layer_ids is None:  # vLLM's default where the target has the layers for it
        aux_layer_ids = [2, layers // 2, layers - 3] if layers >= 5 else [0, layers // 2, layers - 1]
    hidden = target["hidden_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": hidden, "target_hidden_size": hidden, "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"], "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target.get("head_dim") or hidden // target["num_attention_heads"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6), "rope_theta": target.get("rope_theta", 10000.0),
        "max_position_embeddings": target.get("max_position_embeddings", 2048), "hidden_act": "silu",
        "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_random_eagle3_head(target_dir: str, out_dir: str, draft_vocab_size: Optional[int] = None,
                             aux_layer_ids: Optional[Sequence[int]] = None, seed: int = 0) -> str:
    """Write a random EAGLE-3 head for the checkpoint at ``target_dir`` into ``out_dir``."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    target = target.get("text_config", target)
    cfg = head_config(target, draft_vocab_size or target["vocab_size"], aux_layer_ids)
    os.makedirs(out_dir, exist_ok=True)
    save_file(head_tensors(cfg, cfg["draft_vocab_size"], seed), os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="the target checkpoint's directory")
    parser.add_argument("out", help="where to write the head")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="the head's vocabulary (a random subset of the target's; default: all of it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_eagle3_head(args.target, args.out, args.draft_vocab_size, seed=args.seed))


if __name__ == "__main__":
    main()
