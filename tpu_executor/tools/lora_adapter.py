"""Write a random LoRA adapter for a checkpoint in PEFT's layout (``adapter_config.json`` and
``adapter_model.safetensors``, tensors ``base_model.model.<module>.lora_A.weight`` ``[r, in]``
and ``lora_B.weight`` ``[out, r]``): what tests and benchmarks serve, since no trained adapter
can be had here. B is not zero (as PEFT initialises it) but random, scaled to change outputs.
``python -m tpu_executor.tools.lora_adapter TARGET OUT [--rank R] [--targets q_proj v_proj ...]``.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Dict, Optional, Sequence

import torch

from tpu_executor.core.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE, AdapterConfig, module_path, projection_shapes


def adapter_tensors(cfg: Dict, targets: Sequence[str], ranks: Dict[str, int], seed: int,
                    strength: float) -> Dict[str, torch.Tensor]:
    """Random A (std 1/sqrt(in)) and B (std ``strength``/sqrt(r)) for every layer's ``targets``;
    ``ranks``: each module's rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(cfg), {}
    for layer in range(cfg["num_hidden_layers"]):
        for projection in targets:
            module = f"model.layers.{layer}.{module_path(projection)}"
            (in_features, out_features), rank = shapes[projection], ranks[module]
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * strength / rank ** 0.5
    return tensors


def write_random_lora_adapter(target_dir: str, out_dir: str, rank: int = 8, alpha: Optional[float] = None,
                              targets: Sequence[str] = TARGETS, seed: int = 0, strength: float = 0.5,
                              use_rslora: bool = False, rank_pattern: Optional[Dict[str, int]] = None,
                              alpha_pattern: Optional[Dict[str, float]] = None) -> str:
    """Write a random adapter for the checkpoint at ``target_dir`` into ``out_dir``; returns it.
    ``rank_pattern`` / ``alpha_pattern`` (PEFT's) give some modules their own rank and alpha."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"targets {unknown} are not projections an adapter may target ({', '.join(TARGETS)})")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
              "target_modules": list(targets), "use_rslora": use_rslora, "rank_pattern": rank_pattern or {},
              "alpha_pattern": alpha_pattern or {}, "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
              "modules_to_save": None, "use_dora": False, "task_type": "CAUSAL_LM",
              "base_model_name_or_path": os.path.abspath(target_dir)}
    parsed = AdapterConfig.parse(config, out_dir)
    ranks = {f"model.layers.{layer}.{module_path(p)}": parsed.rank_of(f"model.layers.{layer}.{module_path(p)}")
             for layer in range(cfg["num_hidden_layers"]) for p in targets}
    os.makedirs(out_dir, exist_ok=True)
    save_file(adapter_tensors(cfg, targets, ranks, seed, strength), os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("target", help="the base model's checkpoint directory")
    parser.add_argument("out", help="directory to write the adapter into")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_lora_adapter(args.target, args.out, args.rank, targets=args.targets, seed=args.seed))


if __name__ == "__main__":
    main()
