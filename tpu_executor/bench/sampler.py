"""``tpu-executor bench sampler``: what the sampler costs per step, plain and with logits
processing (penalties, a 300-entry logit bias and a grammar's token mask on every row), on the
device and on the host.

    tpu-executor bench sampler                          # XLA, 32, 64 and 256 rows, SmolLM2's tokenizer
    tpu-executor bench sampler --device cpu --rows 64 --tokenizer DIR

Device: the compiled sampler on random logits (half the rows sampled, half greedy), median
milliseconds per call after a warm-up call, synchronized; the processing graph always applies
a token mask (all tokens allowed for rows without a grammar), so one figure covers both. Host:
building one call's processing inputs for rows that all process their logits
(``ProcessingSlots.prepare``), and the grammar work of one step for rows that all follow a JSON
schema (each matcher fills its row's bitmask and accepts a token it allows: ``GrammarMatchers``).
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
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 64, 256], help="rows per sampler call")
    parser.add_argument("--tokenizer", default=None, help="checkpoint directory whose tokenizer sets the vocabulary "
                                                          "and the grammar's tokens (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=30, help="timed calls of each kind")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from tpu_executor.tools.default_model import prepare

    device = torch.device("xla") if args.device == "xla" else torch.device(args.device)
    if args.device == "xla":
        import torch_xla  # noqa: F401 - registers the device
    path = args.tokenizer or prepare()
    tokenizer, vocab = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size
    print(f"Vocabulary: {vocab} tokens ({path})\n")
    print("| rows | sampler ms, plain | with penalties + 300-entry bias + token mask | host ms, processing inputs "
          "| host ms, grammar masks and advance |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        plain, processed, host = measure(rows, vocab, device, args.steps)
        grammar = grammar_step_ms(rows, tokenizer, vocab, args.steps)
        print(f"| {rows} | {plain:.2f} | {processed:.2f} | {host:.2f} | {grammar:.2f} |", flush=True)


def grammar_step_ms(rows: int, tokenizer, vocab: int, steps: int) -> float:
    """Median host milliseconds of one step's grammar work for ``rows`` rows following a JSON
    schema: fill every bitmask, then advance every matcher by a token its mask allows (the
    choice of that token is not timed)."""
    import numpy as np

    from tpu_executor.bench.structured import RECORDS
    from tpu_executor.core.sampling_params import StructuredOutputsParams
    from tpu_executor.engine.structured_outputs import GrammarCompiler, GrammarMatchers

    matchers = GrammarMatchers(GrammarCompiler.for_tokenizer(tokenizer, vocab))
    ids = [f"row{r}" for r in range(rows)]
    for sample_id in ids:
        matchers.add(sample_id, StructuredOutputsParams(json=RECORDS))
    rng, times = random.Random(0), []
    for _ in range(steps):
        start = time.perf_counter()
        masks = matchers.bitmasks(ids)
        elapsed = time.perf_counter() - start
        chosen = {sample_id: int(rng.choice(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))))
                  for sample_id, mask in masks.items()}
        start = time.perf_counter()
        for sample_id, token in chosen.items():
            assert matchers.accept(sample_id, token) is None
        times.append(elapsed + time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(rows: int, vocab: int, device: torch.device, steps: int):
    """(plain ms, processed ms, host ms) per call at ``rows`` rows."""
    from tpu_executor.worker.logits_processing import ProcessingRows, ProcessingSlots
    from tpu_executor.worker.transfer import to_device

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
    processed_inputs = ProcessingRows(**to_device(processing._asdict(), device))
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
    from tpu_executor.worker.sampling_runner import SampleSteps

    feed = torch.zeros(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    fn = _compiled("plain", SampleSteps.sample, logits.device)
    return fn(logits, feed_tokens=feed, num_logprobs=0, all_greedy=False, **sampling)[0].token_ids


def _processed(logits, sampling, rows, state):
    from tpu_executor.worker.sampling_runner import SampleSteps

    feed = torch.zeros(logits.shape[0] + 1, dtype=torch.int64, device=logits.device)
    fn = _compiled("processed", SampleSteps.sample_processed, logits.device)
    return fn(logits, feed_tokens=feed, num_logprobs=0, all_greedy=False, state=state, rows=rows,
              **sampling)[0].token_ids


def timed(call: Callable, device: torch.device, steps: int) -> float:
    """Median milliseconds of ``call`` (after one warm-up call), waiting for the device each time."""
    call().cpu()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call().cpu()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
