"""The vLLM-CPU side of ``tpu-executor bench throughput --vllm-python``: runs one workload
through vLLM's offline ``LLM`` and prints its figures as one JSON line.

It runs under the Python of a virtual environment that holds vLLM-CPU (which pins its own
torch; ``scripts/setup_vllm_cpu.sh`` makes one), as a script: it imports nothing of
tpu_executor. The workload file is JSON: ``{"model", "prompts", "max_tokens", "max_model_len",
"max_num_seqs"}``. vLLM gets what our engine gets: fp32, greedy, EOS ignored, prefix caching
off, a warm-up generate before the timed one, every core of this machine bound to its threads.
"""
from __future__ import annotations

import json
import os
import sys
import time


def cpu_environment() -> None:
    """vLLM-CPU's thread binding (every core) and KV cache size (GiB), unless already set."""
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"], seed=0)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    warmup_prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (16, 200)]
    llm.generate(warmup_prompts, params, use_tqdm=False)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / elapsed, "seconds": elapsed, "warmup_s": warmup,
            "tokens": tokens}


def main() -> None:
    with open(sys.argv[1]) as workload:
        spec = json.load(workload)
    cpu_environment()
    result = run(spec)
    print("VLLM_PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
