"""``tpu-executor bench structured``: output tokens/s of a JSON-schema workload against the same
workload unconstrained, one engine, side by side in one run.

    tpu-executor bench structured                      # SmolLM2 on the native path
    tpu-executor bench structured --models gemma-100m --devices xla cpu

Workload: ``bench throughput``'s (32 prompts of 16-256 tokens, 64 new tokens each, greedy). The
constrained pass asks every request for a JSON list of at least 1,000 records, which no output
completes within 64 tokens: every token is sampled under the grammar's mask (the matchers fill
one bitmask per row per step and advance by each token), and the outputs are exactly as long as
the unconstrained ones (EOS ignored). Plain and constrained passes alternate, each on prompts
of their own (shifted ids, so no pass reads another's prefix cache), and the table gives the
median of each and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import MODELS, NEW_TOKENS, Workload, model_path, shifted
from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args

RECORDS = {"type": "array", "minItems": 1000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "score", "tags"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                   "score": {"type": "number"}, "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                         "maxItems": 3}}}}
ENGINE_DEFAULTS = dict(max_model_len=320, max_num_seqs=32, prefill_buckets=(128, 256, 320, 384, 448, 512),
                       decode_buckets=(8, 16, 32), decode_context_buckets=(160, 320))
WHY_DEFAULTS = "Defaults fit the workload (32 prompts of 16-256 tokens, 64 new), as in bench throughput."


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("structured", help="JSON-schema outputs against unconstrained ones",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2"],
                        help=f"{', '.join(MODELS)} or a checkpoint directory")
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="xla, cpu, ...")
    parser.add_argument("--repeats", type=int, default=3, help="plain and constrained passes of each engine")
    add_engine_arguments(parser, exclude=("device",), defaults=ENGINE_DEFAULTS, why=WHY_DEFAULTS)
    parser.set_defaults(run=run)
    return parser


def timed_pass(llm, prompts: List[List[int]], constrained: bool) -> float:
    """Output tokens/s of one pass over ``prompts``."""
    from tpu_executor.core.sampling_params import SamplingParams, StructuredOutputsParams

    grammar = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, structured_outputs=grammar)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if constrained and not outputs[0].outputs[0].text.startswith("[{"):
        raise RuntimeError(f"the constrained output does not follow its schema: {outputs[0].outputs[0].text[:60]!r}")
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def run_engine(path: str, options: Dict, repeats: int) -> Dict[str, float]:
    """Median tokens/s of the plain and the constrained passes, and the engine's compilations
    after warm-up."""
    from transformers import AutoConfig

    from tpu_executor.entrypoints.llm import LLM

    vocab_size = AutoConfig.from_pretrained(path).vocab_size
    prompts = Workload().prompts(vocab_size)
    llm = LLM(model=path, **options)
    timed_pass(llm, prompts, constrained=True)  # compiles the grammar; its prompts are not used again
    rates: Dict[bool, List[float]] = {False: [], True: []}
    for _ in range(repeats):
        for constrained in (False, True):
            prompts = shifted(prompts, vocab_size)
            rates[constrained].append(timed_pass(llm, prompts, constrained))
    compiled = llm.stats().graphs_compiled_after_warmup
    llm.shutdown()
    return {"plain": statistics.median(rates[False]), "json": statistics.median(rates[True]), "compiled": compiled}


def run(args: argparse.Namespace) -> None:
    base = engine_options_from_args(args)
    print("| model | path | unconstrained tok/s | JSON schema tok/s | ratio | compilations after warm-up |")
    print("|---|---|---|---|---|---|")
    for name in args.models:
        path = model_path(name) if name in MODELS else name
        for device in args.devices:
            result = run_engine(path, dict(base, device=device), args.repeats)
            label = "XLA" if device == "xla" else f"native ({device})"
            print(f"| {name} | {label} | {result['plain']:.1f} | {result['json']:.1f} | "
                  f"{result['json'] / result['plain']:.2f}x | {result['compiled']} |", flush=True)
    print(f"\nHardware: {cpu_description()}. Workload: bench throughput's prompts, {NEW_TOKENS} new tokens, greedy, "
          f"EOS ignored; median of {args.repeats} alternating passes each.")
