"""``tpu-executor bench startup``: how long an engine takes to start, cold (an empty compile
cache) and warm (the same cache again: a restart), on the JAX path with 1 and N compile threads
and on the torch_xla path, each start in a fresh process.

Every start is a new Python process that builds the engine with the throughput workload's bucket
plan and answers one request, so the figure is what a restart costs a user: imports, loading
the checkpoint, allocating the KV cache, compiling (or loading) every graph of the plan. The
torch_xla path's persistent cache cannot load executables on a CPU (nor, in torch_xla 2.9, on
a TPU), so it starts cold every time; it runs once, for comparison.

    tpu-executor bench startup                              # gemma-100m and the default model
    tpu-executor bench startup --models gemma-100m --threads 1 2 --skip-xla
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import ENGINE_DEFAULTS, MODELS, model_path
from tpu_executor.engine.options import HelpFormatter

CHILD = """
import json, sys, time
start = time.perf_counter()
from tpu_executor import LLM, SamplingParams
options = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], **options)
ready = time.perf_counter() - start
llm.generate([{"prompt_token_ids": list(range(5, 40))}], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
stats = llm.stats()
print("RESULT " + json.dumps(dict(ready_s=ready, startup=stats.startup_seconds,
                                  compiled=stats.graphs_compiled_at_warmup, hits=stats.compile_cache_hits,
                                  compile_s=stats.compile_seconds, after=stats.graphs_compiled_after_warmup)))
llm.shutdown()
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("startup", help="engine start-up, cold and warm compile cache",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-100m", "smollm2"], choices=MODELS)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="compile threads of the JAX path's cold starts (the warm start uses the last)")
    parser.add_argument("--skip-xla", action="store_true", help="leave out the torch_xla path's start")
    parser.set_defaults(run=run)
    return parser


def start_once(path: str, options: Dict) -> Dict:
    """One engine start in a fresh process: its figures, and the process's wall time."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, path, json.dumps(options)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"engine start failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]), process_s=time.perf_counter() - began)


def model_runs(name: str, threads: List[int], skip_xla: bool) -> List[Dict]:
    """The starts of one model: JAX cold per thread count, JAX warm, torch_xla cold."""
    path = model_path(name)
    base = dict(ENGINE_DEFAULTS, show_progress=False)
    runs = []
    for count in threads:
        with tempfile.TemporaryDirectory() as cache:
            options = dict(base, device="jax", cache_dir=cache, compile_threads=count)
            runs.append(dict(start_once(path, options), path="jax", cache="cold", threads=count))
            if count == threads[-1]:
                runs.append(dict(start_once(path, options), path="jax", cache="warm", threads=count))
    if not skip_xla:
        runs.append(dict(start_once(path, dict(base, device="xla", cache_dir=None)), path="xla", cache="cold",
                         threads=1))
    for run_ in runs:
        print(f"{name} [{run_['path']}, {run_['cache']}, {run_['threads']} thread(s)]: ready in "
              f"{run_['process_s']:.1f} s (engine {run_['ready_s']:.1f} s, warm-up "
              f"{run_['startup'].get('warmup', 0):.1f} s), {run_['compiled']} graphs compiled, "
              f"{run_['hits']} loaded from the cache", flush=True)
    return runs


def run(args: argparse.Namespace) -> None:
    rows = [(name, model_runs(name, args.threads, args.skip_xla)) for name in args.models]
    print("\n| model | path | compile cache | compile threads | process start to ready s | warm-up s | "
          "graphs compiled | loaded from cache | warm / cold |\n|---|---|---|---|---|---|---|---|---|")
    for name, runs in rows:
        cold = next(r for r in runs if r["path"] == "jax" and r["cache"] == "cold" and r["threads"] == args.threads[-1])
        for r in runs:
            share = f"{r['process_s'] / cold['process_s']:.0%}" if r["cache"] == "warm" else "-"
            print(f"| {name} | {'JAX (torchax)' if r['path'] == 'jax' else 'torch_xla'} | {r['cache']} | "
                  f"{r['threads']} | {r['process_s']:.1f} | {r['startup'].get('warmup', 0):.1f} | {r['compiled']} | "
                  f"{r['hits']} | {share} |")
    print(f"\nHardware: {cpu_description()}. Each start is a fresh process; bucket plan of "
          "`bench throughput` (6 prefill, 3 x 2 decode buckets).")
