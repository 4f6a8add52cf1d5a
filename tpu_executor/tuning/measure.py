"""Measurements on this machine: a candidate's buckets in the real engine (warm-up, graphs,
throughput on a trace sample, recompilations), and the cost model held against measured step
times of a few buckets.
"""
from __future__ import annotations

import dataclasses
import random
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from tpu_executor.core.buckets import BucketPlan, DecodeGraph, Graph, PrefillGraph
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.tuning.replay import ReplayResult, add_trace_request
from tpu_executor.tuning.roofline import Chip, CostModel, ModelShape
from tpu_executor.tuning.schemes import Plan
from tpu_executor.tuning.traces import TraceRequest


@dataclass(frozen=True)
class Measured:
    """One candidate run for real on this machine."""

    warmup_s: float
    graphs_at_warmup: int
    graphs_after_warmup: int
    output_tokens: int
    run_s: float
    trace_tokens_per_s: float = 0.0  # the whole replayed trace at this machine's step times

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.run_s

    @property
    def seconds_per_graph(self) -> float:
        return self.warmup_s / self.graphs_at_warmup if self.graphs_at_warmup else 0.0


def run_engine(engine: LLMEngine, trace: Sequence[TraceRequest], seed: int = 0) -> Measured:
    """Serve ``trace`` (all at once, random prompt ids, exact output lengths) on ``engine``."""
    stats = engine.stats()
    warmup_s, graphs = stats.startup_seconds.get("warmup", 0.0), stats.graphs_compiled_at_warmup
    rng = random.Random(seed)
    for request in trace:
        add_trace_request(engine, request, rng, engine.vocab_size)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.token_ids) for delta in engine.step() for out in delta.outputs)
    run_s = time.perf_counter() - start
    return Measured(warmup_s, graphs, engine.stats().graphs_compiled_after_warmup, tokens, run_s)


def replayed_model_seconds(engine: LLMEngine, result: ReplayResult) -> float:
    """The replayed trace's model calls, each at the measured time of the graph ``engine``
    would run it on: the whole trace's model time here, without serving all of it."""
    calls = result.graphs_under(BucketPlan.from_config(engine.config))
    graphs = sorted({graph for _, graph in calls}, key=repr)
    seconds = dict(zip(graphs, engine.core.executor.time_graphs(graphs, repeats=3)))
    return sum(seconds[graph] for _, graph in calls)


def measure_finalists(model_dir: str, options: Dict, finalists: Sequence[Tuple[str, Plan]],
                      sample: Sequence[TraceRequest], result: ReplayResult,
                      shape: ModelShape) -> Tuple[Dict[str, Measured], List["CostCheck"]]:
    """Each finalist's buckets in a real engine: serving ``sample``, and the whole replayed
    trace at measured step times; the last finalist also checks the cost model."""
    runs: Dict[str, Measured] = {}
    checks: List[CostCheck] = []
    for index, (name, plan) in enumerate(finalists):
        engine = LLMEngine.from_options(model_dir, **{**options, **plan.options()})
        try:
            run = run_engine(engine, sample)
            trace_rate = result.output_tokens / replayed_model_seconds(engine, result)
            runs[name] = dataclasses.replace(run, trace_tokens_per_s=trace_rate)
            if index == len(finalists) - 1:
                graphs = check_graphs(BucketPlan.from_config(engine.config))
                checks = check_cost_model(engine, shape, measure_cpu_chip(), graphs)
        finally:
            engine.shutdown()
    return runs, checks


# ---- the cost model against this machine --------------------------------------------------
def measure_cpu_chip(size: int = 1024, copy_mib: int = 256) -> Chip:
    """This CPU as a roofline 'chip': fp32 matmul FLOP/s and copy bandwidth, measured now."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    flops = _best_rate(lambda: a @ b, 2.0 * size ** 3)
    src = torch.empty(copy_mib << 18)  # fp32: 4 bytes an element
    dst = torch.empty_like(src)
    bandwidth = _best_rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4)
    return Chip("this CPU (measured)", 0, bandwidth, flops, 0)


def _best_rate(fn, work: float, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return work / best


@dataclass(frozen=True)
class CostCheck:
    """A graph's step time measured here beside the cost model's estimate for this CPU."""

    graph: Graph
    measured_s: float
    estimated_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.estimated_s


def check_cost_model(engine: LLMEngine, shape: ModelShape, chip: Chip, graphs: List[Graph]) -> List[CostCheck]:
    """Time ``graphs`` on ``engine``'s device and estimate them with the roofline of ``chip``
    (fp32 weights and activations, as the CPU runs them; the reference attention reads the
    full context width)."""
    cost = CostModel(shape, chip, tp=1, weight_bytes=4, act_bytes=4, head_bytes=4,
                     max_logit_rows=engine.config.compile.max_prefill_seqs)
    measured = engine.core.executor.time_graphs(graphs)
    bs = engine.config.cache.block_size
    estimates = [cost.prefill_seconds(g) if isinstance(g, PrefillGraph) else cost.decode_seconds(g, bs)
                 for g in graphs]
    return [CostCheck(g, m, e) for g, m, e in zip(graphs, measured, estimates)]


def check_graphs(plan: BucketPlan) -> List[Graph]:
    """A few graphs spanning the plan: the smallest and largest prefill and decode."""
    rows, widths = plan.decode_row_buckets, plan.decode_context_block_buckets
    picks = [PrefillGraph(plan.prefill_token_buckets[0]), PrefillGraph(plan.prefill_token_buckets[-1]),
             DecodeGraph(rows[0], widths[0]), DecodeGraph(rows[-1], widths[-1])]
    return list(dict.fromkeys(picks))
