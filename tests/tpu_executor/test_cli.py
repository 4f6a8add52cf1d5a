"""The installed ``tpu-executor`` command, run as a user would (from outside the repository);
``--help`` against the engine each command builds; and the native path in a process where
torch_xla, jax and ray cannot be imported."""
from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
import textwrap

import pytest

from tests.common import hf_greedy
from tpu_executor.cli import build_parser
from tpu_executor.core.config import EngineConfig
from tpu_executor.engine.options import build_engine_config, engine_options_from_args, option_fields
from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.paged_attention import cpu_native as paged_native
from tpu_executor.worker.model_loader import checkpoint_limit, load_hf_config

TINY_ENGINE_FLAGS = ["--max-model-len", "96", "--prefill-buckets", "96", "--decode-buckets", "4",
                     "--decode-context-buckets", "96", "--num-blocks", "64"]


def run_tpu_executor(args, cwd, timeout=600) -> subprocess.CompletedProcess:
    result = subprocess.run(["tpu-executor", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def tpu_executor(args, cwd, timeout=600) -> str:
    return run_tpu_executor(args, cwd, timeout).stdout


def test_every_subcommand_takes_the_same_engine_options(tmp_path):
    for command in (["generate"], ["serve"], ["bench", "throughput"], ["bench", "serve"]):
        help_text = tpu_executor([*command, "--help"], cwd=tmp_path)
        for flag in ("--max-model-len", "--prefill-buckets", "--block-size", "--strict", "--max-num-seqs"):
            assert flag in help_text, (command, flag)


ENGINE_COMMANDS = (["generate"], ["serve"], ["tune", "--trace", "chat"], ["bench", "throughput"], ["bench", "serve"])


def shown_defaults(help_text: str):
    """{option name: the default ``--help`` shows for it} over every engine flag that shows one."""
    flat = " ".join(help_text.split("engine options:", 1)[1].split())
    shown = {}
    for _, f in option_fields():
        flag = "--" + f.name.replace("_", "-")
        negated = "(?:, --no-" + re.escape(flag[2:]) + ")?"
        match = re.search(re.escape(flag) + negated + r" (?:(?! --[a-z]).)*?\(default: ([^)]*)\)", flat)
        if match:
            shown[f.name] = match.group(1)
    return shown


def parsed(shown: str):
    """A default as --help prints it, read back: a number, a boolean or text."""
    return ast.literal_eval(shown) if re.fullmatch(r"-?[0-9.]+|True|False", shown) else shown


def config_value(config: EngineConfig, name: str):
    if name == "max_model_len":
        return config.max_model_len  # as resolved for the checkpoint
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        if dataclasses.is_dataclass(value) and name in {f.name for f in dataclasses.fields(value)}:
            return getattr(value, name)
    raise KeyError(name)


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_help_shows_the_defaults_the_command_uses(command, checkpoints, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command[0], "--help"] if command[0] != "bench" else command[:2] + ["--help"])
    shown = shown_defaults(capsys.readouterr().out)
    config = build_engine_config(checkpoints["llama"], **engine_options_from_args(build_parser().parse_args(command)))
    assert len(shown) >= 20, sorted(shown)
    for name, text in shown.items():
        if name == "max_model_len" and text.startswith("the checkpoint's context length"):
            assert config.max_model_len == checkpoint_limit(load_hf_config(checkpoints["llama"])), command
        elif name == "dtype" and text == "auto":  # resolved for the device: fp32 on this CPU
            assert config.model.dtype == "float32", command
        elif name == "async_scheduling" and text == "on for xla, jax and cuda, off for cpu":
            assert config.scheduler.async_scheduling == (config.device.device != "cpu"), command
        elif name == "max_cpu_loras" and text == "max_loras":
            assert config.lora.max_cpu_loras == config.lora.max_loras, command
        elif name != "num_blocks":  # "as many as fit": sized by the worker
            value = config_value(config, name)
            expected = tuple(parsed(w) for w in text.split()) if isinstance(value, tuple) else parsed(text)
            assert expected == value, (command, name, text)


def test_scheduling_is_asynchronous_by_default_where_the_device_runs_apart_from_the_host(checkpoints):
    resolved = {device: build_engine_config(checkpoints["llama"], device=device).scheduler.async_scheduling
                for device in ("xla", "jax", "cuda", "cpu")}
    assert resolved == {"xla": True, "jax": True, "cuda": True, "cpu": False}
    explicit = build_engine_config(checkpoints["llama"], device="cpu", async_scheduling=True)
    assert explicit.scheduler.async_scheduling is True
    flags = engine_options_from_args(build_parser().parse_args(["generate", "--no-async-scheduling"]))
    assert flags["async_scheduling"] is False


def test_generate_from_outside_the_repository(checkpoints, tmp_path):
    result = run_tpu_executor(["generate", checkpoints["llama"], "--device", "cpu", "--prompt", "ka lo mi",
                               "--no-chat-template", "--max-tokens", "8", *TINY_ENGINE_FLAGS], cwd=tmp_path)
    out = result.stdout
    assert ">>> ka lo mi" in out and "8 tokens in" in out and "recompilations after warm-up: 0" in out
    # The native path's start-up report names each op's provider, and says when a C kernel
    # stands aside on a CPU without AVX-512.
    kernels = dict(item.split("=") for item in out.split("\nkernels: ")[1].splitlines()[0].split(", "))
    built = cpu_library.can_build()
    assert kernels["paged_attention"] == ("cpu_c" if built else "eager_sdpa") and "rms_norm" in kernels
    wide = built and paged_native.wide_vectors()
    assert kernels["prefill_attention"] == ("cpu_c" if wide else "eager_segments")
    assert ("prefill_attention C kernel stands aside" in result.stderr) == (built and not wide), result.stderr[-2000:]


def test_a_bad_option_fails_with_what_to_change(checkpoints, tmp_path):
    result = subprocess.run(["tpu-executor", "generate", checkpoints["llama"], "--device", "cpu",
                             "--block-size", "12"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "block_size must be one of 8, 16, 32, 64, 128" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.startswith("tpu-executor generate: error: ")


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
    try:
        LLM(sys.argv[1], device="xla")
    except ValueError as err:
        assert "device 'xla' needs torch_xla" in str(err), err
    else:
        raise AssertionError("device 'xla' started without torch_xla")
    print(json.dumps([o.outputs[0].token_ids for o in outs]))
""")


def test_native_path_needs_no_torch_xla_jax_or_ray(checkpoints, tmp_path):
    """Where torch_xla cannot install (Arm, macOS) the native path runs, and device 'xla' says
    what is missing."""
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
