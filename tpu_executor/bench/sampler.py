"""``tpu-executor bench sampler``: what the sampler costs per step, plain and with logits
processing (penalties and a 300-entry logit bias on every row), on the device and on the host.

    tpu-executor bench sampler                          # XLA, 32 and 256 rows, a 49,152-token vocabulary
    tpu-executor bench sampler --device cpu --rows 64 --vocab 128256

Device: the compiled sampler on random logits (half the rows sampled, half greedy), median
milliseconds per call after a warm-up call, synchronized. Host: building one call's processing
inputs for rows that all process their logits (``ProcessingSlots.prepare``).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Callable, Dict, List

import torch

from tpu_executor.engine.options import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("sampler", help="the sampler's cost per step, plain and with logits processing",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--device", default="xla", help="xla or a torch device (cpu)")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 256], help="rows per sampler call")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's by default)")
    parser.add_argument("--steps", type=int, default=30, help="timed calls of each kind")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    device = torch.device("xla") if args.device == "xla" else torch.device(args.device)
    if args.device == "xla":
        import torch_xla  # noqa: F401 - registers the device
    print("| rows | sampler ms, plain | with penalties + 300-entry bias | host ms to build the processing inputs |")
    print("|---|---|---|---|")
    for rows in args.rows:
        plain, processed, host = measure(rows, args.vocab, device, args.steps)
        print(f"| {rows} | {plain:.2f} | {processed:.2f} | {host:.2f} |", flush=True)


def measure(rows: int, vocab: int, device: torch.device, steps: int):
    """(plain ms, processed ms, host ms) per call at ``rows`` rows."""
    from tpu_executor.worker.inputs import to_device
    from tpu_executor.worker.logits_processing import ProcessingSlots

    work = processed_work(rows, vocab)
    slots = ProcessingSlots(rows, vocab, device)
    slots.begin_step([w.request_id for w in work])
    processing, fills = slots.prepare(work, rows)
    start = time.perf_counter()
    for _ in range(steps):
        slots.prepare(work, rows)
    host_ms = (time.perf_counter() - start) / steps * 1e3
    sampling = to_device(sampler_inputs(rows), device)
    logits = torch.randn(rows, vocab).to(device)
    plain = lambda: _plain(logits, sampling)  # noqa: E731
    processed_inputs = to_device(processing, device)
    with_processing = lambda: _processed(logits, sampling, processed_inputs, slots.state)  # noqa: E731
    return timed(plain, device, steps), timed(with_processing, device, steps), host_ms


def processed_work(rows: int, vocab: int) -> List:
    """Decode-like work items whose requests all process their logits (a history each)."""
    from types import SimpleNamespace

    from tpu_executor.core.request import logits_processing
    from tpu_executor.core.sampling_params import SamplingParams

    rng = random.Random(0)
    items = []
    for row in range(rows):
        params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                                logit_bias={rng.randrange(vocab): rng.uniform(-5, 5) for _ in range(300)})
        sampling = SimpleNamespace(processing=logits_processing(params, frozenset({2}), ()), prompt_len=8)
        items.append(SimpleNamespace(request_id=f"r{row}", sampling=sampling, history=tuple(range(3, 40))))
    return items


def sampler_inputs(rows: int) -> Dict[str, torch.Tensor]:
    return {"temperature": torch.tensor([0.8 if r % 2 else 0.0 for r in range(rows)]),
            "top_k": torch.zeros(rows, dtype=torch.int64), "top_p": torch.full((rows,), 0.9),
            "min_p": torch.zeros(rows), "seeds": torch.arange(rows), "steps": torch.full((rows,), 5),
            "slots": torch.full((rows,), rows, dtype=torch.int64)}


_COMPILED: Dict[str, Callable] = {}


def _compiled(name: str, fn: Callable, device: torch.device) -> Callable:
    if device.type != "xla":
        return fn
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(fn, backend="openxla", fullgraph=True, dynamic=False)
    return _COMPILED[name]


def _plain(logits, sampling):
    from tpu_executor.worker.model_runner import ModelRunner

    feed = torch.zeros(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    fn = _compiled("plain", ModelRunner._sample_step, logits.device)
    return fn(logits, feed_tokens=feed, num_logprobs=0, all_greedy=False, **sampling)[0].token_ids


def _processed(logits, sampling, processing, state):
    from tpu_executor.worker.model_runner import ModelRunner

    feed = torch.zeros(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    fn = _compiled("processed", ModelRunner._sample_processed_step, logits.device)
    return fn(logits, feed_tokens=feed, num_logprobs=0, all_greedy=False, state=state, **sampling,
              **processing)[0].token_ids


def timed(call: Callable, device: torch.device, steps: int) -> float:
    """Median milliseconds of ``call`` (after one warm-up call), waiting for the device each time."""
    call().cpu()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call().cpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
