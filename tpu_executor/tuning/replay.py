"""Replay a trace through the real engine with a null device: the scheduler, the prefill
packing and the bucket plan are the serving code; only the model is missing.

The null worker answers every scheduled request with one token and records each model call
the plan makes of a step (packed prefill sizes, decode rows and context widths). Requests ask
for exactly their trace output length (``ignore_eos``), so each ends where the trace says. A
step costs no device time, so thousands of requests replay in seconds. Arrival times are
honoured on a virtual clock when a cost model says how long each step would take.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence, Tuple

from tqdm import tqdm

from tpu_executor.core.buckets import BucketPlan, Graph, MixedCall, ModelCall, PrefillCall
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.core.step import ModelRunnerOutput, PaddingStats, SampledTokens, SchedulerOutput, WorkerStats
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.engine.stats import EngineStats
from tpu_executor.executor.base import Executor
from tpu_executor.tuning.traces import TraceRequest

NULL_TOKEN_ID = 1
StepCost = Callable[[List[ModelCall]], float]  # seconds one step's model calls take


class NullTokenizer:
    """A tokenizer with no text: every token decodes to nothing, and there is no EOS."""

    eos_token_id = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return ""


class NullWorker:
    """A worker without a model (a ``WorkerLike``): one token per scheduled request, every
    model call recorded."""

    def __init__(self, config: EngineConfig, vocab_size: int, num_blocks: int):
        self.config = config
        self.plan = BucketPlan.from_config(config)
        self.vocab_size, self.num_blocks = vocab_size, num_blocks
        self.padding = PaddingStats()
        self.steps: List[List[ModelCall]] = []

    def init_device(self) -> str:
        return "null"

    def load_model(self) -> int:
        return self.vocab_size

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.num_blocks = num_blocks
        if max_model_len != self.config.max_model_len:
            self.config = dataclasses.replace(self.config, max_model_len=max_model_len)
            self.plan = BucketPlan.from_config(self.config)

    def warmup(self, show_progress: bool) -> None:
        """Nothing to compile."""

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        calls = self.plan.model_calls(step)
        for call in calls:
            call.count_into(self.padding)
        self.steps.append(calls)
        sampled = step.sampled_request_ids
        return ModelRunnerOutput(SampledTokens(sampled, [NULL_TOKEN_ID] * len(sampled), [0.0] * len(sampled)))

    def launch_step(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Runs the step at once: nothing is left on a device to collect."""
        return self.execute_model(step)

    def collect_step(self) -> ModelRunnerOutput:
        raise RuntimeError("the null worker's launch_step answered every step at once: nothing to collect")

    def time_graphs(self, graphs: List[Graph], repeats: int) -> List[float]:
        raise ValueError("the null worker has no device to time graphs on")

    def stats(self) -> WorkerStats:
        return WorkerStats(padding=self.padding)

    def close(self) -> None:
        """Nothing to release."""


class NullExecutor(Executor):
    """The executor contract over one ``NullWorker``."""

    def __init__(self, config: EngineConfig, vocab_size: int, num_blocks: int):
        super().__init__(config)
        self.worker = NullWorker(config, vocab_size, num_blocks)

    def _call_workers(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> List[Any]:
        return [getattr(self.worker, method)(*args)]

    def shutdown(self) -> None:
        self.worker.close()


@dataclass
class ReplayResult:
    """What a replay saw: every step's model calls, the engine's figures, and its own cost."""

    steps: List[List[ModelCall]]
    stats: EngineStats
    output_tokens: int
    replay_seconds: float
    virtual_seconds: float = 0.0
    calls: List[ModelCall] = field(init=False)

    def __post_init__(self):
        # A mixed call (eager devices) counts as the prefill and decode calls it joins.
        self.calls = [part for step in self.steps for call in step
                      for part in ((call.prefill, call.decode) if isinstance(call, MixedCall) else (call,))]

    def graphs_under(self, plan: BucketPlan) -> List[Tuple[ModelCall, Graph]]:
        """Each replayed model call with the graph ``plan`` would run it on."""
        return [(call, plan.pack_graph(call.pack) if isinstance(call, PrefillCall)
                 else plan.decode_graph(len(call.work), max(call.needed_blocks))) for call in self.calls]


def replay(config: EngineConfig, trace: Sequence[TraceRequest], vocab_size: int, num_blocks: Optional[int] = None,
           step_cost: Optional[StepCost] = None, seed: int = 0, show_progress: bool = False) -> ReplayResult:
    """Run ``trace`` through an engine of ``config`` on the null device. ``num_blocks`` is the
    KV cache size (default: room for ``max_num_seqs`` full-length sequences, so nothing is
    preempted); with ``step_cost`` requests arrive at their trace times on a virtual clock,
    else all at once."""
    blocks = num_blocks or config.scheduler.max_num_seqs * config.max_blocks_per_seq + 1
    executor = NullExecutor(config, vocab_size, blocks)
    engine = LLMEngine(config, NullTokenizer(), executor=executor, show_progress=False)
    rng = random.Random(seed)
    pending = sorted(trace, key=lambda r: r.arrival_s or 0.0) if step_cost else list(trace)
    start, clock, next_request, output_tokens = time.perf_counter(), 0.0, 0, 0
    progress = tqdm(total=len(pending), desc="replaying on the null device", unit="req", disable=not show_progress)
    while next_request < len(pending) or engine.has_unfinished_requests():
        while next_request < len(pending) and (step_cost is None or (pending[next_request].arrival_s or 0.0) <= clock):
            add_trace_request(engine, pending[next_request], rng, vocab_size)
            next_request += 1
        if not engine.has_unfinished_requests():
            clock = pending[next_request].arrival_s or clock
            continue
        steps_before = len(executor.worker.steps)
        for delta in engine.step():
            output_tokens += sum(len(out.token_ids) for out in delta.outputs)
            progress.update(int(delta.finished))
        if step_cost is not None and len(executor.worker.steps) > steps_before:
            clock += step_cost(executor.worker.steps[-1])
    progress.close()
    stats = engine.stats()
    engine.shutdown()
    return ReplayResult(executor.worker.steps, stats, output_tokens, time.perf_counter() - start, clock)


def add_trace_request(engine: LLMEngine, request: TraceRequest, rng: random.Random, vocab_size: int) -> None:
    """Queue ``request`` on ``engine``: random prompt ids, exactly its output length, greedy."""
    # Random ids: no two prompts share a prefix by accident (the trace says nothing of content).
    prompt = [rng.randrange(2, vocab_size) for _ in range(request.prompt_len)]
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0.0)
    engine.add_request({"prompt_token_ids": prompt}, params, prompt_token_ids=prompt)
