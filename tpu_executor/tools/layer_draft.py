"""Write a draft model for speculative decoding from a target checkpoint's first layers.

The draft is the target cut after ``num_layers`` decoder layers, with the target's embedding,
final norm and LM head: it shares the tokenizer by construction and needs no training (the
layer-skip form of self-speculation). Its drafts are the target's early guesses; how often they
hold depends on the model (``tpu-executor bench speculative --draft-layers N`` measures it).

    python -m tpu_executor.tools.layer_draft TARGET_DIR OUT_DIR --num-layers 8
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil

LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Files a checkpoint directory carries besides its config and weights (the tokenizer's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def write_layer_draft(target_dir: str, out_dir: str, num_layers: int) -> str:
    """Write the first ``num_layers`` layers of the checkpoint at ``target_dir`` (with its
    embedding, norm, head and tokenizer) to ``out_dir``; returns ``out_dir``."""
    from safetensors.torch import load_file, save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be from 1 to {total - 1} (the target has {total} layers), "
                         f"got {num_layers}")
    files = sorted(glob.glob(os.path.join(target_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"{target_dir!r} has no .safetensors weights")
    kept = {}
    for path in files:
        for name, tensor in load_file(path).items():
            match = LAYER_KEY.search(name)
            if match is None or int(match.group(1)) < num_layers:
                kept[name] = tensor.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        draft_config = {**config, "num_hidden_layers": num_layers}
        if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Gemma 2/3, Qwen)
            draft_config["layer_types"] = config["layer_types"][:num_layers]
        json.dump(draft_config, f, indent=2)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(target_dir, name)):
            shutil.copy(os.path.join(target_dir, name), out_dir)
    return out_dir


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--num-layers", type=int, required=True, help="decoder layers the draft keeps")
    args = parser.parse_args(argv)
    print(write_layer_draft(args.target_dir, args.out_dir, args.num_layers))


if __name__ == "__main__":
    main()
