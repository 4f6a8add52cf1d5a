"""``tpu-executor bench chunked-prefill``: inter-token latency of running requests while a long
prompt arrives, chunked prefill versus whole prompts, side by side in one run.

Workload: ``--num-running`` requests (32-token prompts, seeded random ids) decode
``--output-len`` tokens each, greedy; once every one has its first token, a prompt of
``--long-prompt-len`` tokens arrives. Each engine step's deltas are time-stamped when ``step()``
returns; the inter-token latency (ITL) of a running request is the time between two of its
tokens, counted from the long prompt's arrival on. Chunked: prompts are cut at
``--chunk-tokens`` (the token budget, and the largest prefill bucket). Whole prompts: the budget
and the largest prefill bucket are ``max_model_len``, so the long prompt prefills in one call
while every running request waits. Prints ITL p50 / p99 / max, the long prompt's time to first
token, warm-up seconds and the graphs of each engine's bucket plan, then a Markdown table. On
XLA the second engine finds the graphs both plans share in XLA's in-process cache: its warm-up
is shorter than a fresh start (compare warm-ups in separate processes).

    tpu-executor bench chunked-prefill                       # SmolLM2, native path, 2,048 context
    tpu-executor bench chunked-prefill --device xla --max-model-len 8192 --long-prompt-len 8000 --chunk-tokens 512
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Dict, List

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import MODELS, model_path
from tpu_executor.core.buckets import BucketPlan
from tpu_executor.engine.options import HelpFormatter

SHORT_PROMPT_TOKENS = 32
CONFIGS = ("chunked", "whole prompts")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chunked-prefill", help="inter-token latency with a long prompt arriving, "
                                   "chunked vs whole", description=__doc__,
                                   formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"one of {', '.join(MODELS)}, or a checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu (native path) or xla")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--long-prompt-len", type=int, default=1800)
    parser.add_argument("--chunk-tokens", type=int, default=256, help="token budget of the chunked engine")
    parser.add_argument("--num-running", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=48)
    parser.set_defaults(run=run)
    return parser


def engine_options(args: argparse.Namespace, chunked: bool) -> Dict:
    """The two engines differ only in chunking, the token budget and the largest prefill bucket."""
    budget = args.chunk_tokens if chunked else args.max_model_len
    buckets = tuple(b for b in (32, 64, 128, 256, 512, 1024, 2048, 4096) if b < budget) + (budget,)
    return dict(device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.num_running + 1,
                enable_chunked_prefill=chunked, max_num_batched_tokens=budget, prefill_buckets=buckets,
                decode_buckets=(args.num_running + 1,), decode_context_buckets=(512,), show_progress=False)


def measure(path: str, args: argparse.Namespace, chunked: bool, vocab_size: int) -> Dict:
    """Start an engine, run the workload, return its latencies and start-up figures."""
    from tpu_executor.core.sampling_params import SamplingParams
    from tpu_executor.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine.from_options(path, **engine_options(args, chunked))
    warmup_s = time.perf_counter() - start
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_running):
        engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(SHORT_PROMPT_TOKENS)]},
                           params, request_id=f"run{i}")
    try:
        result = _run(engine, args, rng, vocab_size)
        stats = engine.stats()
    finally:
        engine.shutdown()
    # XLA's in-process cache serves the second engine the graphs both plans share: count the plan.
    graphs = len(BucketPlan.from_config(engine.config).graphs()) if args.device == "xla" else 0
    return dict(result, warmup_s=warmup_s, graphs=graphs, graphs_after=stats.graphs_compiled_after_warmup)


def _run(engine, args: argparse.Namespace, rng: random.Random, vocab_size: int) -> Dict:
    """Step until the running requests have their first tokens, add the long prompt, step to
    the end; the gaps between each running request's tokens from then on."""
    from tpu_executor.core.sampling_params import SamplingParams

    last_token_at: Dict[str, float] = {}
    gaps: List[float] = []
    arrived_at = first_long_token_at = None
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.perf_counter()
        for delta in deltas:
            if delta.request_id == "long":
                first_long_token_at = first_long_token_at or now
                continue
            if arrived_at is not None and delta.request_id in last_token_at:
                gaps.append(now - last_token_at[delta.request_id])
            last_token_at[delta.request_id] = now
        if arrived_at is None and len(last_token_at) == args.num_running:
            long_prompt = [rng.randrange(3, vocab_size) for _ in range(args.long_prompt_len)]
            engine.add_request({"prompt_token_ids": long_prompt}, SamplingParams(temperature=0, max_tokens=1),
                               request_id="long")
            arrived_at = time.perf_counter()
    gaps.sort()
    return {"p50": statistics.median(gaps), "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "max": gaps[-1], "ttft": first_long_token_at - arrived_at, "samples": len(gaps)}


def run(args: argparse.Namespace) -> List:
    """Measure both engines and print their figures; returns (config name, result) rows."""
    from transformers import AutoConfig

    if not os.path.isdir(args.model) and args.model not in MODELS:
        raise SystemExit(f"--model {args.model!r} is neither one of {', '.join(MODELS)} nor a checkpoint directory")
    if args.long_prompt_len + 1 > args.max_model_len:
        raise SystemExit(f"--long-prompt-len {args.long_prompt_len} leaves no room for output in "
                         f"--max-model-len {args.max_model_len}")
    path = args.model if os.path.isdir(args.model) else model_path(args.model)
    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    rows = []
    for name, chunked in zip(CONFIGS, (True, False)):
        result = measure(path, args, chunked, vocab_size)
        print(f"{name}: ITL p50 {result['p50'] * 1e3:.1f} ms, p99 {result['p99'] * 1e3:.1f} ms, max "
              f"{result['max'] * 1e3:.1f} ms over {result['samples']} gaps; long prompt TTFT {result['ttft']:.2f} s; "
              f"warm-up {result['warmup_s']:.1f} s, {result['graphs']} graphs in the plan, "
              f"{result['graphs_after']} compiled after warm-up")
        rows.append((name, result))
    print_table(args, rows)
    return rows


def print_table(args: argparse.Namespace, rows) -> None:
    path = "XLA" if args.device == "xla" else f"native eager ({args.device})"
    print("\n| prefill | ITL p50 ms | ITL p99 ms | ITL max ms | long prompt TTFT s | warm-up s | graphs |\n"
          "|---|---|---|---|---|---|---|")
    for name, r in rows:
        budget = f"chunks of {args.chunk_tokens}" if name == "chunked" else "whole prompts"
        print(f"| {budget} | {r['p50'] * 1e3:.1f} | {r['p99'] * 1e3:.1f} | {r['max'] * 1e3:.1f} | {r['ttft']:.2f} | "
              f"{r['warmup_s']:.0f} | {r['graphs']} |")
    print(f"\nHardware: {cpu_description()}. Model: {args.model}, {path}, max_model_len {args.max_model_len}. "
          f"Workload: {args.num_running} running requests (32-token prompts, {args.output_len} new tokens, greedy), "
          f"one {args.long_prompt_len}-token prompt arriving once each has its first token.")
