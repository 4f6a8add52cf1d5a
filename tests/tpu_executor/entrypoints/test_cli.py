"""The installed ``tpu-executor`` command, run as a user would (from outside the repository),
and the native path in a process where torch_xla, jax and ray cannot be imported."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.common import hf_greedy

TINY_ENGINE_FLAGS = ["--max-model-len", "96", "--prefill-buckets", "96", "--decode-buckets", "4",
                     "--decode-context-buckets", "96", "--num-blocks", "64"]


def tpu_executor(args, cwd, timeout=600) -> str:
    result = subprocess.run(["tpu-executor", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_every_subcommand_takes_the_same_engine_options(tmp_path):
    for command in (["generate"], ["serve"], ["bench", "throughput"], ["bench", "serve"]):
        help_text = tpu_executor([*command, "--help"], cwd=tmp_path)
        for flag in ("--max-model-len", "--prefill-buckets", "--block-size", "--strict", "--max-num-seqs"):
            assert flag in help_text, (command, flag)


def test_generate_from_outside_the_repository(checkpoints, tmp_path):
    out = tpu_executor(["generate", checkpoints["llama"], "--device", "cpu", "--prompt", "ka lo mi",
                        "--no-chat-template", "--max-tokens", "8", *TINY_ENGINE_FLAGS], cwd=tmp_path)
    assert ">>> ka lo mi" in out and "8 tokens in" in out and "recompilations after warm-up: 0" in out


def test_a_bad_option_fails_with_what_to_change(checkpoints, tmp_path):
    result = subprocess.run(["tpu-executor", "generate", checkpoints["llama"], "--device", "cpu",
                             "--block-size", "12"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "block_size must be one of 8, 16, 32, 64, 128" in result.stderr


NATIVE_WITHOUT_XLA = textwrap.dedent("""
    import json, sys
    for name in ("torch_xla", "jax", "jaxlib", "ray", "torchax"):
        sys.modules[name] = None  # "not installed": importing it raises ImportError
    from tpu_executor import LLM, SamplingParams
    llm = LLM(sys.argv[1], device="cpu", max_model_len=96, prefill_buckets=(96,), decode_buckets=(4,),
              decode_context_buckets=(96,), num_blocks=64, show_progress=False)
    prompts = json.loads(sys.argv[2])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
""")


def test_native_path_needs_no_torch_xla_jax_or_ray(checkpoints, tmp_path):
    prompts = [[5, 6, 7, 8], list(range(20, 60))]
    result = subprocess.run([sys.executable, "-c", NATIVE_WITHOUT_XLA, checkpoints["llama"], json.dumps(prompts)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    expected, _ = hf_greedy(checkpoints["llama"], prompts, 12)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


@pytest.mark.slow
def test_generate_prints_real_smollm2_text(smollm2_path, tmp_path):
    """The default model (converted on first use), on the native path: real text."""
    out = tpu_executor(["generate", "--device", "cpu", "--prompt", "What is the capital of France?",
                        "--max-tokens", "16"], cwd=tmp_path)
    assert "Paris" in out
