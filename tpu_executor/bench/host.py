"""``tpu-executor bench host``: the host's work per engine step, phase by phase.

The real engine (scheduler, KV-cache manager, model runner's input building and sampler,
detokenizer) runs with the model step replaced by one that computes nothing: its logits pick a
fixed function of each input token, so the detokenizer sees varied text. What remains is what
the host does between two device steps, which on a TPU is time the chip waits.

    tpu-executor bench host                              # 32, 256 and 1,024 running sequences
    tpu-executor bench host --num-seqs 256 --steps 100
    tpu-executor bench host --device xla --num-seqs 32 256 --overlap   # + the real model, sync vs async
    tpu-executor bench host --num-seqs 256 --overlap --device-ms 2 5    # + a device of 2 and 5 ms a step

For each number of running sequences it measures a decode step (every sequence decodes) and a
mixed step (``JOINING`` sequences leave and as many new prompts prefill in the same step), and
prints milliseconds per step split into scheduling, input preparation, transfer, output
processing and detokenization; ``device`` (the sampler and the empty model step) is shown apart
and not counted as host work.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch

from tpu_executor.bench.null_model import NullModelWorker, held_device_worker
from tpu_executor.core.phase_timer import DEVICE_PHASES, HOST_PHASES, PHASES, PhaseTimer
from tpu_executor.engine.options import HelpFormatter
from tpu_executor.executor import WorkerMaker
from tpu_executor.worker.worker import Worker

PROMPT_TOKENS = 32
JOINING = 8  # sequences that leave and join per mixed step
VOCAB = 8192  # asked of the tokenizer trainer; it may learn fewer tokens


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("host", help="host work per engine step (model step replaced by nothing)",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256, 1024],
                        help="running sequences to measure at")
    parser.add_argument("--steps", type=int, default=50, help="measured steps of each kind")
    parser.add_argument("--device", default="cpu", help="cpu (native path) or xla")
    parser.add_argument("--output-kind", nargs="+", choices=("delta", "final_only"), default=["delta"],
                        help="what the requests ask the engine to hand out: a delta every step (streaming) "
                             "or only the final output (LLM.generate)")
    parser.add_argument("--overlap", action="store_true",
                        help="also run the real model: step time sync vs async beside its host and device parts")
    parser.add_argument("--device-ms", type=float, nargs="+", default=None,
                        help="overlap figures (as --overlap) for a simulated device instead of the real model: "
                             "its decode step lasts this many milliseconds without using the host's cores "
                             "(cpu only)")
    parser.set_defaults(run=run)
    return parser


def tiny_checkpoint() -> str:
    """A 2-layer Llama and a tokenizer trained for it (cached); the model's vocabulary is the
    tokenizer's, which learns fewer than the ``VOCAB`` tokens it is asked for."""
    from tpu_executor.tools.random_checkpoint import TINY, build

    path = os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "host-bench-llama")
    return build(path, "llama", dict(TINY, vocab_size=VOCAB))


def engine_for(path: str, num_seqs: int, steps: int, device: str, worker_class: WorkerMaker = NullModelWorker,
               async_scheduling: bool = False, core_process: bool = False):
    """An engine sized for ``num_seqs`` sequences of the benchmark (by default with the empty
    model step, synchronous and in one process, so the phases add up to the step)."""
    from tpu_executor.engine.llm_engine import LLMEngine

    max_model_len = PROMPT_TOKENS + 2 * steps + 32
    context_bucket = -(-max_model_len // 16) * 16
    rows = tuple(sorted({min(2 ** k, num_seqs) for k in range(3, num_seqs.bit_length() + 1)} | {num_seqs}))
    blocks_per_seq = context_bucket // 16
    return LLMEngine.from_options(
        path, show_progress=False, worker_class=worker_class, device=device, max_num_seqs=num_seqs,
        async_scheduling=async_scheduling, core_process=core_process,
        max_model_len=max_model_len, max_num_batched_tokens=num_seqs + JOINING * PROMPT_TOKENS,
        prefill_buckets=(JOINING * PROMPT_TOKENS, context_bucket), decode_buckets=rows,
        decode_context_buckets=(context_bucket,), num_blocks=num_seqs * (blocks_per_seq + 1) + 1,
        max_prefill_seqs=JOINING, enable_prefix_caching=False)


def _add_requests(engine, count: int, rng: random.Random, max_tokens: int, output_kind: str = "delta") -> List[str]:
    from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind[output_kind.upper()])
    def prompt():
        return {"prompt_token_ids": [rng.randrange(3, engine.vocab_size) for _ in range(PROMPT_TOKENS)]}

    return [engine.add_request(prompt(), params) for _ in range(count)]


class GcClock:
    """Seconds the garbage collector ran while active, in all and in its longest collection
    (a ``gc.callbacks`` hook). A collection lands in whichever phase triggered it, so the
    table shows it apart; the longest one is the engine's worst stall (a full collection over
    an unfrozen heap took a fifth of a second at ~1,000 sequences)."""

    def __init__(self):
        self.seconds = 0.0
        self.longest = 0.0
        self._start = 0.0

    def _on_gc(self, phase: str, info: dict) -> None:  # noqa: ARG002 - gc's callback signature
        if phase == "start":
            self._start = time.perf_counter()
        else:
            took = time.perf_counter() - self._start
            self.seconds += took
            self.longest = max(self.longest, took)

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)


class CoreClock:
    """Seconds the engine spent in its core's ``step`` (scheduling, the executor, recording
    tokens) while active; the rest of an engine step is the front-end's (text, stop strings,
    deltas), which a core in its own process would not wait for."""

    def __init__(self, engine):
        self.seconds = 0.0
        self._core = engine.core

    def _step(self):
        start = time.perf_counter()
        try:
            return type(self._core).step(self._core)
        finally:
            self.seconds += time.perf_counter() - start

    def __enter__(self) -> "CoreClock":
        self._core.step = self._step  # an instance attribute: the class's method is left alone
        return self

    def __exit__(self, *exc) -> None:
        del self._core.step


def _timed_steps(engine, timer: PhaseTimer, steps: int, before_step=None) -> Dict[str, float]:
    """Milliseconds per step of each phase over ``steps`` steps (median wall time too, the
    core's and the front-end's shares of the host time, and the garbage collector's share,
    which is inside the phases)."""
    timer.reset()
    walls = []
    with GcClock() as gc_clock, CoreClock(engine) as core_clock:
        for _ in range(steps):
            if before_step is not None:
                before_step()
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
    ms = {phase: 1e3 * timer.seconds.get(phase, 0.0) / steps for phase in PHASES}
    ms["device"] = sum(ms.pop(p) for p in DEVICE_PHASES)
    ms["other"] = 1e3 * sum(walls) / steps - sum(ms.values())
    ms["host"] = sum(ms[p] for p in HOST_PHASES) + ms["other"]
    ms["core"] = 1e3 * core_clock.seconds / steps - ms["device"]
    ms["front-end"] = ms["host"] - ms["core"]
    ms["median_step"] = 1e3 * statistics.median(walls)
    ms["gc"] = 1e3 * gc_clock.seconds / steps
    ms["gc max"] = 1e3 * gc_clock.longest
    return ms


def _fill(engine, num_seqs: int, rng: random.Random, output_kind: str = "delta") -> List[str]:
    """Queue ``num_seqs`` endless requests and step until all decode; their ids. A request
    that ends before then (an error, or a stop) would leave the batch short forever: it is
    an error naming why."""
    running = _add_requests(engine, num_seqs, rng, 10 ** 6, output_kind)
    while (stats := engine.stats()).num_waiting or stats.num_running < num_seqs:
        _check_none_finished(engine.step())
    for _ in range(3):
        _check_none_finished(engine.step())
    return running


def _check_none_finished(outputs) -> None:
    for output in outputs:
        if output.finished:
            reason = output.error or ", ".join(str(c.finish_reason) for c in output.outputs)
            raise RuntimeError(f"request {output.request_id} ended while the benchmark's batch was filling "
                               f"({reason}); its requests are meant to run until aborted")


def measure(path: str, num_seqs: int, steps: int, device: str,
            output_kind: str = "delta") -> Dict[str, Dict[str, float]]:
    """Per-phase milliseconds of a decode step and of a mixed step at ``num_seqs`` sequences
    whose requests ask for ``output_kind`` outputs (``delta``: streamed every step;
    ``final_only``: one output at the end, as ``LLM.generate`` asks)."""
    engine = engine_for(path, num_seqs, steps, device)
    timer = PhaseTimer()
    engine.attach_phase_timer(timer)
    rng = random.Random(0)
    running = _fill(engine, num_seqs, rng, output_kind)
    decode = _timed_steps(engine, timer, steps)

    def swap_some():  # JOINING sequences leave, as many new prompts join
        for request_id in running[:JOINING]:
            engine.abort_request(request_id)
        running[:JOINING] = []
        running.extend(_add_requests(engine, JOINING, rng, 10 ** 6, output_kind))

    swap_some()
    engine.step()
    mixed = _timed_steps(engine, timer, steps, before_step=swap_some)
    engine.shutdown()
    return {"decode": decode, "mixed": mixed}


def overlap(path: str, num_seqs: int, steps: int, device: str, device_ms: Optional[float] = None) -> Dict[str, float]:
    """Steady decode step time of the real model (or of a device held ``device_ms`` a step):
    synchronous, asynchronous, and asynchronous with the engine core in its own process,
    beside the host part, the core's share of it, and the device part (milliseconds). With the
    real model the parts come from the synchronous run's phases: device = the model and
    sampler calls plus reading the tokens back (on XLA the calls only dispatch; the wait for
    the device lands in the read-back), host = the rest. With a held device, device =
    ``device_ms`` and host = the rest of the synchronous step (nothing overlaps there)."""
    worker_class = Worker if device_ms is None else held_device_worker(device_ms)
    figures: Dict[str, float] = {}
    for mode, async_scheduling, core_process in (("sync", False, False), ("async", True, False),
                                                 ("core process", True, True)):
        engine = engine_for(path, num_seqs, steps, device, worker_class, async_scheduling, core_process)
        timer = PhaseTimer()
        # Phases add up only when nothing overlaps; a held device's host part needs none.
        if mode == "sync" and device_ms is None:
            engine.attach_phase_timer(timer)
        _fill(engine, num_seqs, random.Random(0))
        ms = _timed_steps(engine, timer, steps)
        if mode != "sync":
            figures[mode] = ms["median_step"]
        elif device_ms is not None:
            figures.update(sync=ms["median_step"], device=device_ms, host=ms["median_step"] - device_ms,
                           core=ms["core"] - device_ms)
        else:
            figures.update(sync=ms["median_step"], device=ms["device"] + ms["transfer"],
                           host=ms["host"] - ms["transfer"], core=ms["core"] - ms["transfer"])
        engine.shutdown()
    return figures


def print_overlap(results: Dict[Tuple[int, str], Dict[str, float]], device: str) -> None:
    print("\n| sequences | device step | host | core | device | host + device | sync step | async step | "
          "async, core process | async / max(host, device) | core process / max(core, device) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for (num_seqs, label), f in results.items():
        print(f"| {num_seqs} | {label} | {f['host']:.2f} | {f['core']:.2f} | {f['device']:.2f} | "
              f"{f['host'] + f['device']:.2f} | {f['sync']:.2f} | {f['async']:.2f} | {f['core process']:.2f} | "
              f"{f['async'] / max(f['host'], f['device']):.2f} | "
              f"{f['core process'] / max(f['core'], f['device']):.2f} |")
    print(f"\nMilliseconds per decode step on {device}; sync and async steps are medians over the measured "
          "steps. Device step `model`: the real model (the checkpoint's random weights); host and device are "
          "the synchronous run's phases (device: model and sampler calls and reading the tokens back; host: "
          "the rest). `N ms held`: a simulated device that takes N ms a step without the host's cores, "
          "queued as on XLA; device = N, host = the rest of the synchronous step. core: the engine core's "
          "share of host (the rest is the front-end's text, stop strings and deltas); `async, core process`: "
          "the core in a process of its own, so only its share stands between two device steps.")


def _overlaps(args: argparse.Namespace, path: str) -> Dict[Tuple[int, str], Dict[str, float]]:
    """The overlap figures ``--overlap`` asks for: the real model's, or each held device's."""
    kinds = [(f"{ms:g} ms held", ms) for ms in args.device_ms or ()] or [("model", None)]
    return {(num_seqs, label): overlap(path, num_seqs, args.steps, args.device, device_ms)
            for num_seqs in args.num_seqs for label, device_ms in kinds}


def print_table(results: Dict[int, Dict[str, Dict[str, float]]], vocab_size: int) -> None:
    columns = HOST_PHASES + ("other", "host", "core", "front-end", "device", "gc", "gc max")
    print("\n| sequences | outputs | step | " + " | ".join(columns) + " | host us/seq |")
    print("|---|---|---|" + "---|" * (len(columns) + 1))
    for (num_seqs, output_kind), kinds in results.items():
        for kind, ms in kinds.items():
            cells = " | ".join(f"{ms[c]:.2f}" for c in columns)
            print(f"| {num_seqs} | {output_kind} | {kind} | {cells} | {1e3 * ms['host'] / num_seqs:.1f} |")
    print("\nMilliseconds per step (mean over the measured steps); host = the phase columns and other; "
          "core + front-end = host: the engine core's step (scheduling, inputs, the executor, recording tokens) "
          "and the front-end's work on its output (text, stop strings, deltas); "
          "gc = garbage collection, already counted in whichever phase it interrupted; "
          "gc max = the longest single collection (ms, not per step). "
          f"Prompts of {PROMPT_TOKENS} tokens, greedy, vocabulary {vocab_size:,}; a mixed step has {JOINING} "
          "prompts joining while the other sequences decode.")


def run(args: argparse.Namespace) -> None:
    if args.device_ms is not None and (args.device != "cpu" or min(args.device_ms) <= 0):
        raise SystemExit("--device-ms takes milliseconds > 0 and runs on --device cpu (a held step cannot "
                         f"be compiled for XLA); got --device {args.device} --device-ms {args.device_ms}")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = tiny_checkpoint()
    results = {}
    for num_seqs in args.num_seqs:
        for output_kind in args.output_kind:
            kinds = results[num_seqs, output_kind] = measure(path, num_seqs, args.steps, args.device, output_kind)
            print(f"{num_seqs} sequences, {output_kind} outputs: decode step host {kinds['decode']['host']:.2f} ms "
                  f"(core {kinds['decode']['core']:.2f}), "
                  f"device {kinds['decode']['device']:.2f} ms; mixed step host {kinds['mixed']['host']:.2f} ms",
                  flush=True)
    with open(os.path.join(path, "config.json")) as config:
        print_table(results, json.load(config)["vocab_size"])
    if args.overlap or args.device_ms:
        print_overlap(_overlaps(args, path), args.device)
