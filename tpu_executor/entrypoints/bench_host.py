"""``tpu-executor bench host``: the host's work per engine step, phase by phase.

The real engine (scheduler, KV-cache manager, model runner's input building and sampler,
detokenizer) runs with the model step replaced by one that computes nothing: its logits pick a
fixed function of each input token, so the detokenizer sees varied text. What remains is what
the host does between two device steps, which on a TPU is time the chip waits.

    tpu-executor bench host                              # 32, 256 and 1,024 running sequences
    tpu-executor bench host --num-seqs 256 --steps 100

For each number of running sequences it measures a decode step (every sequence decodes) and a
mixed step (``JOINING`` sequences leave and as many new prompts prefill in the same step), and
prints milliseconds per step split into scheduling, input preparation, transfer, output
processing and detokenization; ``device`` (the sampler and the empty model step) is shown apart
and not counted as host work.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Dict, List

import torch

from tpu_executor.core.phase_timer import PHASES, PhaseTimer
from tpu_executor.worker.model_runner import ModelRunner
from tpu_executor.worker.worker import Worker

PROMPT_TOKENS = 32
JOINING = 8  # sequences that leave and join per mixed step
VOCAB = 8192  # asked of the tokenizer trainer; it may learn fewer tokens
HOST_PHASES = tuple(p for p in PHASES if p != "device")


def next_token_logits(input_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """One-hot logits whose argmax is a fixed function of each input token (no model compute)."""
    next_ids = (input_ids * 7919 + 13) % (vocab_size - 3) + 3  # skip the special tokens
    logits = torch.zeros(input_ids.shape[0], vocab_size, device=input_ids.device)
    return logits.scatter(1, next_ids[:, None], 1.0)


class NullModelRunner(ModelRunner):
    """The model runner with an empty model step: inputs, transfers and the sampler are real."""

    def _prefill_step(self, input_ids, positions, slot_mapping, context_slots, key_positions,
                      key_segments, query_segments, logits_indices, kv_caches):
        return next_token_logits(input_ids[logits_indices], self.model.config.vocab_size)

    def _decode_step(self, input_ids, positions, slot_mapping, block_tables, context_lens, kv_caches):
        return next_token_logits(input_ids, self.model.config.vocab_size)


class NullModelWorker(Worker):
    """A worker whose runner computes no model (the checkpoint only gives shapes and vocabulary)."""

    runner_class = NullModelRunner


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("host", help="host work per engine step (model step replaced by nothing)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[32, 256, 1024],
                        help="running sequences to measure at")
    parser.add_argument("--steps", type=int, default=50, help="measured steps of each kind")
    parser.add_argument("--device", default="cpu", help="cpu (native path) or xla")
    parser.set_defaults(run=run)
    return parser


def tiny_checkpoint() -> str:
    """A 2-layer Llama with an 8,192-token vocabulary and a trained tokenizer (cached)."""
    from tpu_executor.tools.random_checkpoint import TINY, build

    path = os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "host-bench-llama")
    return build(path, "llama", dict(TINY, vocab_size=VOCAB))


def engine_for(path: str, num_seqs: int, steps: int, device: str):
    """An engine with the empty model step, sized for ``num_seqs`` sequences of the benchmark."""
    from tpu_executor.engine.llm_engine import LLMEngine

    max_model_len = PROMPT_TOKENS + 2 * steps + 32
    context_bucket = -(-max_model_len // 16) * 16
    rows = tuple(sorted({min(2 ** k, num_seqs) for k in range(3, num_seqs.bit_length() + 1)} | {num_seqs}))
    blocks_per_seq = context_bucket // 16
    return LLMEngine.from_options(
        path, show_progress=False, worker_class=NullModelWorker, device=device, max_num_seqs=num_seqs,
        max_model_len=max_model_len, max_num_batched_tokens=num_seqs + JOINING * PROMPT_TOKENS,
        prefill_buckets=(JOINING * PROMPT_TOKENS, context_bucket), decode_buckets=rows,
        decode_context_buckets=(context_bucket,), num_blocks=num_seqs * (blocks_per_seq + 1) + 1,
        max_prefill_seqs=JOINING, enable_prefix_caching=False)


def _add_requests(engine, count: int, rng: random.Random, max_tokens: int) -> List[str]:
    from tpu_executor.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [engine.add_request({"prompt_token_ids": [rng.randrange(3, engine.vocab_size) for _ in range(PROMPT_TOKENS)]},
                               params) for _ in range(count)]


def _timed_steps(engine, timer: PhaseTimer, steps: int, before_step=None) -> Dict[str, float]:
    """Milliseconds per step of each phase over ``steps`` steps (median wall time too)."""
    timer.reset()
    walls = []
    for _ in range(steps):
        if before_step is not None:
            before_step()
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    ms = {phase: 1e3 * timer.seconds.get(phase, 0.0) / steps for phase in PHASES}
    ms["other"] = 1e3 * sum(walls) / steps - sum(ms.values())
    ms["host"] = sum(ms[p] for p in HOST_PHASES) + ms["other"]
    ms["median_step"] = 1e3 * statistics.median(walls)
    return ms


def measure(path: str, num_seqs: int, steps: int, device: str) -> Dict[str, Dict[str, float]]:
    """Per-phase milliseconds of a decode step and of a mixed step at ``num_seqs`` sequences."""
    engine = engine_for(path, num_seqs, steps, device)
    timer = PhaseTimer()
    engine.timer = engine.executor.workers[0].runner.timer = timer
    rng = random.Random(0)
    running = _add_requests(engine, num_seqs, rng, max_tokens=10 ** 6)
    while engine.scheduler.num_waiting or engine.scheduler.num_running < num_seqs:
        engine.step()
    for _ in range(3):
        engine.step()
    decode = _timed_steps(engine, timer, steps)

    def swap_some():  # JOINING sequences leave, as many new prompts join
        for request_id in running[:JOINING]:
            engine.abort_request(request_id)
        running[:JOINING] = []
        running.extend(_add_requests(engine, JOINING, rng, max_tokens=10 ** 6))

    swap_some()
    engine.step()
    mixed = _timed_steps(engine, timer, steps, before_step=swap_some)
    engine.shutdown()
    return {"decode": decode, "mixed": mixed}


def print_table(results: Dict[int, Dict[str, Dict[str, float]]]) -> None:
    columns = HOST_PHASES + ("other", "host", "device")
    print("\n| sequences | step | " + " | ".join(columns) + " | host us/seq |")
    print("|---|---|" + "---|" * (len(columns) + 1))
    for num_seqs, kinds in results.items():
        for kind, ms in kinds.items():
            cells = " | ".join(f"{ms[c]:.2f}" for c in columns)
            print(f"| {num_seqs} | {kind} | {cells} | {1e3 * ms['host'] / num_seqs:.1f} |")
    print("\nMilliseconds per step (mean over the measured steps); host = every column but device. "
          f"Prompts of {PROMPT_TOKENS} tokens, greedy, vocabulary {VOCAB}; a mixed step has {JOINING} "
          "prompts joining while the other sequences decode.")


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    path = tiny_checkpoint()
    results = {}
    for num_seqs in args.num_seqs:
        results[num_seqs] = measure(path, num_seqs, args.steps, args.device)
        decode = results[num_seqs]["decode"]
        print(f"{num_seqs} sequences: decode step host {decode['host']:.2f} ms, device {decode['device']:.2f} ms; "
              f"mixed step host {results[num_seqs]['mixed']['host']:.2f} ms", flush=True)
    print_table(results)
