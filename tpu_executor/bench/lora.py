"""``tpu-executor bench lora``: output tokens per second with LoRA adapters in the batch against
the base model alone, side by side in one run.

For each batch size the same prompts run in one ``LLM.generate`` call on an engine without
adapters (the base), then on engines with ``enable_lora`` (``max_loras`` as many as the
adapters in the batch, at least 1): with no adapter, then with the batch spread over 1, 4,
8... distinct random rank-``--rank`` adapters on every projection (``tools/lora_adapter.py``);
each call is warmed up once first over the same adapters.
Random prompt ids, greedy, EOS ignored, prefix caching off. Prints tok/s and the overhead
against the base, then a Markdown table.

    tpu-executor bench lora                                         # SmolLM2, native path
    tpu-executor bench lora --devices cpu jax --batch-sizes 32 256 --adapters 0 1 4 8
"""
from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import List, Optional, Sequence

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.bench.throughput import MODELS, model_path
from tpu_executor.engine.options import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("lora", help="tok/s with LoRA adapters in the batch against the base model",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="smollm2", help=f"one of {', '.join(MODELS)}, or a checkpoint directory")
    parser.add_argument("--devices", nargs="+", default=["cpu"], help="cpu (native path), xla or jax")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[32])
    parser.add_argument("--adapters", nargs="+", type=int, default=[0, 1, 4, 8],
                        help="distinct adapters in the batch (0: the LoRA engine running the base model only)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.set_defaults(run=run)
    return parser


def engine(path: str, device: str, batch_sizes: Sequence[int], max_loras: int, max_model_len: int):
    """An engine for the run (``max_loras`` 0: no LoRA at all), a decode bucket at every batch
    size measured (a smaller batch padded to a larger bucket would pay for its padding)."""
    from tpu_executor.entrypoints.llm import LLM

    max_batch = max(batch_sizes)
    options = dict(device=device, max_model_len=max_model_len, max_num_seqs=max_batch, enable_prefix_caching=False,
                   prefill_buckets=(64, 128, 256), decode_buckets=tuple(sorted({8, *batch_sizes})),
                   decode_context_buckets=(max_model_len,), max_num_batched_tokens=max(2048, max_batch),
                   show_progress=False)
    if max_loras:
        options.update(enable_lora=True, max_loras=max_loras, max_lora_rank=16)
    return LLM(path, **options)


def timed_rate(llm, prompts: List[List[int]], adapters: Sequence, output_len: int) -> float:
    """Output tok/s of one generate call (after one untimed call over the same adapters)."""
    from tpu_executor.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    lora = list(adapters) if llm.engine.config.lora.enable_lora else None
    llm.generate(batch[:len(set(adapters)) or 1], params, use_tqdm=False,
                 lora_request=lora[:len(set(adapters)) or 1] if lora else None)
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=lora)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def spread(requests: Sequence, batch: int, count: int) -> List[Optional[object]]:
    """``batch`` rows over the first ``count`` adapters in turn (none: the base model)."""
    return [requests[i % count] if count else None for i in range(batch)]


def run(args: argparse.Namespace) -> None:
    from tpu_executor.core.lora import LoRARequest
    from tpu_executor.tools.lora_adapter import write_random_lora_adapter

    path = model_path(args.model)
    rng = random.Random(0)
    max_batch = max(args.batch_sizes)
    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(max_batch)]
    print(f"{cpu_description()}; {args.model}, {args.prompt_len} tokens in, {args.output_len} out, greedy, "
          f"rank-{args.rank} adapters on every projection", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        count = max(args.adapters)
        requests = [LoRARequest(f"a{i}", i + 1, write_random_lora_adapter(path, os.path.join(tmp, f"a{i}"),
                                                                          rank=args.rank, seed=i))
                    for i in range(count)]
        for device in args.devices:
            # The base model on an engine without LoRA, then each mix on an engine with as many
            # slots as it has adapters (the one-hot form's work grows with the slots).
            for adapters in [None, *args.adapters]:
                max_loras = 0 if adapters is None else max(adapters, 1)
                llm = engine(path, device, args.batch_sizes, max_loras,
                             -(-(args.prompt_len + args.output_len) // 64) * 64)
                try:
                    for batch in args.batch_sizes:
                        rate = timed_rate(llm, prompts[:batch], spread(requests, batch, adapters or 0), args.output_len)
                        rows.append(dict(device=device, batch=batch, adapters=adapters, rate=rate))
                        print(f"{device} batch {batch} adapters {'base' if adapters is None else adapters}: "
                              f"{rate:.1f} tok/s", flush=True)
                finally:
                    llm.shutdown()
    print_table(rows)


def print_table(rows: List[dict]) -> None:
    base = {(r["device"], r["batch"]): r["rate"] for r in rows if r["adapters"] is None}
    print("\n| device | batch | adapters in the batch | tok/s | against the base |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = "base model, no LoRA engine" if r["adapters"] is None else str(r["adapters"])
        ratio = r["rate"] / base[(r["device"], r["batch"])]
        print(f"| {r['device']} | {r['batch']} | {name} | {r['rate']:.1f} | {ratio:.2f}x |")
