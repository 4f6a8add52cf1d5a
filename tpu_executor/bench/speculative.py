"""``tpu-executor bench speculative``: output tokens per second with and without speculative
decoding (n-gram drafts; with ``--draft-layers N`` a draft model made of the target's first N
layers; with ``--eagle3-head DIR`` an EAGLE-3 head, ``random`` for a random one), side by side
in one run, on a text-copying and a free-generation workload.

Workloads (chat prompts through the model's template, greedy, EOS ignored, prefix caching off
in both engines): ``copy`` asks the model to rewrite a short generated program with one name
changed (its answer repeats most of its prompt: drafts from the prompt hold); ``free`` asks for
a short story on a topic (nothing to copy: drafts hold only where the text repeats itself).
For each batch size the first ``batch`` prompts run in one ``LLM.generate`` call on the plain
engine, then on the speculative one (each warmed up once first); prints output tok/s of both,
their ratio, the acceptance rate (accepted / drafted tokens) and the mean accepted length
(tokens a verify gave), then a Markdown table.

    tpu-executor bench speculative                                  # SmolLM2, native path
    tpu-executor bench speculative --devices cpu jax --batch-sizes 1 8 64
    tpu-executor bench speculative --draft-layers 8 --batch-sizes 1 8   # draft model (native path)
    tpu-executor bench speculative --eagle3-head random --batch-sizes 1 8   # a random head's cost
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Dict, List, Tuple

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import MODELS, model_path
from tpu_executor.engine.options import HelpFormatter

WORKLOADS = ("copy", "free")
PUBLISHED_DRAFT_VOCAB = 32000  # the draft vocabulary of the published Llama-3 EAGLE-3 heads
TOPICS = ("a lighthouse keeper", "a lost key", "the first day of school", "a robot learning to cook", "a storm at sea",
          "an old map", "a quiet library", "a train that never stops", "a garden in winter", "a forgotten song")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("speculative", help="tok/s with and without speculative decoding",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"one of {', '.join(MODELS)}, or a checkpoint directory")
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="cpu (native path), xla or jax")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="speculate with a draft model of the target's first N layers instead of n-grams")
    parser.add_argument("--eagle3-head", default=None,
                        help="speculate with the EAGLE-3 head in this directory instead of n-grams ('random': "
                             "a random head for the target, drafts that fail: what a head costs)")
    parser.set_defaults(run=run)
    return parser


def program(rng: random.Random) -> str:
    """A short Python program with seeded names and constants."""
    names = rng.sample(["total", "count", "items", "value", "result", "index", "buffer", "limit", "offset", "scale"], 4)
    funcs = rng.sample(["load", "parse", "merge", "scale", "clip", "pack", "split", "sum_up"], 3)
    lines = []
    for func in funcs:
        a, b = rng.sample(names, 2)
        lines += [f"def {func}({a}, {b}):", f"    {a} = {a} + {rng.randint(1, 99)} * {b}",
                  f"    return {a} - {b}", ""]
    return "\n".join(lines)


def chat_prompts(tokenizer, workload: str, count: int) -> List[List[int]]:
    """``count`` prompt token lists of ``workload``, through the model's chat template."""
    rng = random.Random(0)
    prompts = []
    for i in range(count):
        if workload == "copy":
            code = program(rng)
            old = code.split("(")[0].split()[-1]
            text = f"Rewrite this code with the function {old} renamed to {old}_v2. Output the whole code.\n\n{code}"
        else:
            text = f"Write a short story about {TOPICS[i % len(TOPICS)]}."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    return prompts


def engine(path: str, device: str, max_batch: int, speculative: Dict = None):
    from tpu_executor.entrypoints.llm import LLM

    options = dict(device=device, max_model_len=512, max_num_seqs=max_batch, enable_prefix_caching=False,
                   prefill_buckets=(64, 128, 256, 512), decode_buckets=tuple(sorted({1, 8, max_batch})),
                   decode_context_buckets=(512,), show_progress=False)
    return LLM(path, **options, **({} if speculative is None else {"speculative_config": speculative}))


def timed_rate(llm, prompts: List[List[int]], output_len: int) -> float:
    """Output tok/s of one generate call over ``prompts`` (after one untimed call)."""
    from tpu_executor.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch[:1], params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def drafter(args: argparse.Namespace, path: str, tmp: str) -> Tuple[str, Dict]:
    """(the drafter's name, the speculative engine's config): n-grams, a layer draft of the
    target written to ``tmp``, or an EAGLE-3 head (a random one written to ``tmp``)."""
    k = args.num_speculative_tokens
    if args.eagle3_head is not None:
        head = args.eagle3_head
        if head == "random":
            from tpu_executor.tools.eagle3_head import write_random_eagle3_head
            from tpu_executor.worker.model_loader import load_hf_config

            vocab = load_hf_config(path).vocab_size
            head = write_random_eagle3_head(path, os.path.join(tmp, "head"), min(vocab, PUBLISHED_DRAFT_VOCAB))
        return "EAGLE-3 head", {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    if args.draft_layers is not None:
        from tpu_executor.tools.layer_draft import write_layer_draft

        draft = write_layer_draft(path, os.path.join(tmp, "draft"), args.draft_layers)
        return f"{args.draft_layers}-layer draft model", {"method": "draft_model", "model": draft,
                                                          "num_speculative_tokens": k}
    return "n-gram", {"method": "ngram", "num_speculative_tokens": k}


def measure(path: str, device: str, args: argparse.Namespace, prompts: Dict[str, List[List[int]]],
            speculative: Dict) -> List[Dict]:
    """Rows of (workload, batch, plain and speculative tok/s, acceptance) for one device."""
    max_batch = max(args.batch_sizes)
    rows = []
    plain, spec = engine(path, device, max_batch), engine(path, device, max_batch, speculative)
    try:
        for workload in args.workloads:
            for batch in args.batch_sizes:
                before = spec.stats().spec_decode
                before = (before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens)
                plain_rate = timed_rate(plain, prompts[workload][:batch], args.output_len)
                spec_rate = timed_rate(spec, prompts[workload][:batch], args.output_len)
                after = spec.stats().spec_decode
                drafts, drafted, accepted = (after.num_drafts - before[0], after.num_draft_tokens - before[1],
                                             after.num_accepted_tokens - before[2])
                row = dict(device=device, workload=workload, batch=batch, plain=plain_rate, spec=spec_rate,
                           acceptance=accepted / drafted if drafted else 0.0,
                           mean_length=1 + accepted / drafts if drafts else 1.0)
                print(f"{device} {workload} batch {batch}: {plain_rate:.1f} -> {spec_rate:.1f} tok/s "
                      f"({spec_rate / plain_rate:.2f}x), acceptance {row['acceptance']:.0%}, "
                      f"mean accepted length {row['mean_length']:.2f}", flush=True)
                rows.append(row)
    finally:
        plain.shutdown()
        spec.shutdown()
    return rows


def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    path = model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = {w: chat_prompts(tokenizer, w, max(args.batch_sizes)) for w in args.workloads}
    with tempfile.TemporaryDirectory() as tmp:
        method, speculative = drafter(args, path, tmp)
        print(f"{cpu_description()}; {args.model}, {args.output_len} tokens out, greedy, {method}, "
              f"{args.num_speculative_tokens} draft tokens", flush=True)
        rows = [row for device in args.devices for row in measure(path, device, args, prompts, speculative)]
    print(f"\n| device | workload | batch | plain tok/s | {method} tok/s | speed-up | acceptance "
          "| mean accepted length |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['device']} | {r['workload']} | {r['batch']} | {r['plain']:.1f} | {r['spec']:.1f} | "
              f"{r['spec'] / r['plain']:.2f}x | {r['acceptance']:.0%} | {r['mean_length']:.2f} |")
