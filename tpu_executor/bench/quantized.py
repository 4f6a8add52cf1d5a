"""``tpu-executor bench quantized``: decode and prefill speed and accuracy of INT8, INT4 and
W8A8 against the unquantized model on the native path, side by side in one run.

For each model and scheme (``none``: the checkpoint's own fp32 weights) one engine runs, for
each batch size, ``batch`` random prompts of 16 tokens to ``--output-len`` new tokens in one
``LLM.generate`` (greedy, EOS ignored, prefix caching off; warmed up once first), and prints
output tok/s; then ``--prefill-prompts`` random prompts of ``--prefill-len`` tokens to one new
token each (prompt tok/s: where W8A8's INT8 matmul pays). Accuracy: each token's log-prob in a
fixed text of ``--text-len`` tokens (an English paragraph where the checkpoint has a
tokenizer, seeded random ids where it has none; the same ids for every scheme) and their mean
|difference| from the unquantized model's, in nats. Then a Markdown table for docs/benchmarks.md.

    tpu-executor bench quantized --models gemma-100m smollm2 --batch-sizes 1 32 --quantizations none int8 int4 w8a8
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Dict, List

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import MODELS, model_path
from tpu_executor.engine.options import HelpFormatter

PROMPT_LEN = 16
# The fixed text scored for accuracy where the checkpoint has a tokenizer (random ids otherwise).
TEXT = ("The lighthouse keeper climbed the spiral stairs each evening before the sun went down. He "
        "cleaned the great lens, trimmed the wick and wrote the weather in a worn leather book: the "
        "direction of the wind, the height of the waves, the ships that passed and the birds that "
        "rested on the rail. In winter the storms came from the north and the glass shook in its "
        "frame, but the light never went out. Sailors who had never met him knew his name, and when "
        "the fog rolled in from the sea they listened for the horn he sounded every minute until "
        "morning. Years later, when the light was run by a machine, the book was found in a drawer, "
        "every page filled in the same careful hand, and the last entry said only that the sea was calm.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("quantized", help="native-path decode and prefill tok/s and log-prob error, fp32 "
                                                     "vs INT8, INT4, W8A8", description=__doc__,
                                   formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-100m", "smollm2"], choices=MODELS)
    parser.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"],
                        choices=["none", "int8", "int4", "w8a8"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--text-len", type=int, default=256, help="tokens of the fixed text scored for accuracy")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.set_defaults(run=run)
    return parser


def decode_rate(llm, batch: int, output_len: int, vocab: int) -> float:
    """Output tok/s of ``batch`` random prompts in one generate call (after an untimed one)."""
    from tpu_executor.core.sampling_params import SamplingParams

    rng = random.Random(batch)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def prefill_rate(llm, prompts: int, length: int, vocab: int) -> float:
    """Prompt tok/s of ``prompts`` random prompts of ``length`` tokens, one new token each
    (after an untimed call; prefix caching is off, so nothing is reused)."""
    from tpu_executor.core.sampling_params import SamplingParams

    rng = random.Random(length)
    batch = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(prompts)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(batch, params, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(batch, params, use_tqdm=False)
    return prompts * length / (time.perf_counter() - start)


def fixed_text(llm, length: int, vocab: int) -> List[int]:
    """``TEXT``'s first ``length`` token ids (repeated to reach it), or seeded random ids for
    a checkpoint without a tokenizer."""
    tokenizer = llm.get_tokenizer()
    if tokenizer is None:
        return [random.Random(0).randrange(3, vocab) for _ in range(length)]
    ids = tokenizer.encode(TEXT)
    return (ids * (length // len(ids) + 1))[:length]


def text_logprobs(llm, text_ids: List[int]) -> List[float]:
    """The log-prob of each token of ``text_ids`` after the first, given the tokens before it."""
    from tpu_executor.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": text_ids}], params, use_tqdm=False)[0]
    return [position[token] for token, position in zip(text_ids[1:], output.prompt_logprobs[1:])]


def run(args: argparse.Namespace) -> None:
    from tpu_executor.entrypoints.llm import LLM

    print(f"{cpu_description()}; native path, fp32 activations, prompts of {PROMPT_LEN} tokens, "
          f"{args.output_len} out, greedy", flush=True)
    rows: List[Dict] = []
    for name in args.models:
        path = model_path(name)
        reference = None
        for quantization in args.quantizations:
            llm = LLM(path, device="cpu", quantization=None if quantization == "none" else quantization,
                      max_num_seqs=max(args.batch_sizes), enable_prefix_caching=False, show_progress=False,
                      max_model_len=max(args.text_len, args.prefill_len, PROMPT_LEN + args.output_len) + 16)
            try:
                vocab = min(llm.engine.vocab_size, 32000)
                text = fixed_text(llm, args.text_len, vocab)
                logprobs = text_logprobs(llm, text)
                reference = logprobs if quantization == "none" else reference
                error = None if reference is None else sum(abs(a - b) for a, b in zip(logprobs, reference)) / len(text)
                for batch in args.batch_sizes:
                    rows.append(dict(model=name, scheme=quantization, batch=batch, error=error,
                                     rate=decode_rate(llm, batch, args.output_len, vocab)))
                    print(f"{name} {quantization} batch {batch}: {rows[-1]['rate']:.1f} tok/s", flush=True)
                label = f"prefill {args.prefill_prompts} x {args.prefill_len}"
                rows.append(dict(model=name, scheme=quantization, batch=label, error=error,
                                 rate=prefill_rate(llm, args.prefill_prompts, args.prefill_len, vocab)))
                print(f"{name} {quantization} {label}: {rows[-1]['rate']:.1f} prompt tok/s", flush=True)
            finally:
                llm.shutdown()
    print_table(rows)


def print_table(rows: List[Dict]) -> None:
    base = {(r["model"], r["batch"]): r["rate"] for r in rows if r["scheme"] == "none"}
    print("\n| model | weights | batch | tok/s | against fp32 | mean abs log-prob change |\n|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['rate'] / base[(r['model'], r['batch'])]:.2f}x" if (r["model"], r["batch"]) in base else "-"
        error = "-" if r["error"] is None or r["scheme"] == "none" else f"{r['error']:.4f}"
        print(f"| {r['model']} | {'fp32' if r['scheme'] == 'none' else r['scheme'].upper()} | {r['batch']} | "
              f"{r['rate']:.1f} | {ratio} | {error} |")
