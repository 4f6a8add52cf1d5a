"""Bucket tuning: replay a trace on the null device, score every scheme's buckets on what the
runner saw, pick the optimum under the graph budget, and estimate it on a TPU slice.

``tune(...)`` returns a ``TuneReport``; ``entrypoints/tune.py`` prints, plots and writes it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np
from tqdm import tqdm

from tpu_executor.core.buckets import BucketPlan, DecodeCall, DecodeGraph, PrefillCall, PrefillGraph
from tpu_executor.core.config import EngineConfig
from tpu_executor.tuning.lowering import kernel_support, lower_graphs
from tpu_executor.tuning.replay import ReplayResult, replay
from tpu_executor.tuning.roofline import CostModel, HbmFit, ModelShape, Target, hbm_fit, linear_bytes_per_weight
from tpu_executor.tuning.schemes import Dimension, Plan, optimal_tables, recipe_plans, round_up, split_budget
from tpu_executor.tuning.traces import TraceRequest


def with_buckets(config: EngineConfig, plan: Plan) -> EngineConfig:
    """``config`` serving ``plan``'s buckets (the configs validate them again)."""
    return dataclasses.replace(config, compile=dataclasses.replace(config.compile, **plan.options()))


def replay_config(config: EngineConfig) -> EngineConfig:
    """``config`` with only the top buckets: the prefill packing depends on the top prefill
    bucket alone (``max_num_batched_tokens``), so one replay serves every scheme."""
    bs = config.cache.block_size
    top = Plan((config.scheduler.max_num_batched_tokens // bs * bs,), (config.scheduler.max_num_seqs,),
               (round_up(config.max_model_len, bs),))
    return with_buckets(config, top)


def dimensions(result: ReplayResult, config: EngineConfig, row_multiple: int) -> Dict[str, Dimension]:
    """The three bucketed sizes the runner saw in the replay (see ``schemes``)."""
    bs = config.cache.block_size
    prefill = [call.new_tokens for call in result.calls if isinstance(call, PrefillCall)]
    decodes = [call for call in result.calls if isinstance(call, DecodeCall)]
    rows = np.array([len(call.work) for call in decodes])
    widths = np.array([max(call.needed_blocks) * bs for call in decodes])
    top = replay_config(config).compile
    return {"prefill": Dimension("prefill", np.array(prefill), np.ones(len(prefill)), bs, top.prefill_buckets[-1]),
            "rows": Dimension("rows", rows, np.ones(len(rows)), row_multiple, top.decode_buckets[-1]),
            "context": Dimension("context", widths, rows.astype(float), bs, top.decode_context_buckets[-1])}


def plan_of(config: EngineConfig) -> Plan:
    """The buckets ``config`` serves, as the engine cuts them (context in tokens)."""
    plan = BucketPlan.from_config(config)
    return Plan(plan.prefill_token_buckets, plan.decode_row_buckets,
                tuple(b * config.cache.block_size for b in plan.decode_context_block_buckets))


@dataclass
class Candidate:
    """One scheme's buckets and what they cost on the trace."""

    name: str
    plan: Plan
    wastes: Dict[str, float]
    graphs: int  # every graph the engine compiles (model steps and sampler)
    tpu_tokens_per_s: Optional[float] = None

    @property
    def worst_waste(self) -> float:
        return max(self.wastes.values())


def score(name: str, plan: Plan, config: EngineConfig, dims: Dict[str, Dimension]) -> Candidate:
    engine_plan = BucketPlan.from_config(with_buckets(config, plan))
    return Candidate(name, plan, plan.wastes(dims), len(engine_plan.graphs()))


def estimated_seconds(result: ReplayResult, plan: BucketPlan, cost: CostModel, real_context: bool) -> float:
    """Roofline time of the replayed model calls padded to ``plan``. With the Pallas decode
    kernel a row reads only its own context (``real_context``); the reference reads the full
    width."""
    total, bs = 0.0, plan.block_size
    for call, graph in result.graphs_under(plan):
        if isinstance(graph, PrefillGraph):
            total += cost.prefill_seconds(graph)
        else:
            context = sum(call.needed_blocks) * bs / graph.num_rows if real_context else None
            total += cost.decode_seconds(graph, bs, context)
    return total


@dataclass
class TuneReport:
    """Everything ``tune`` found: the replay, each candidate, the choice, the TPU sizing."""

    trace: List[TraceRequest]
    replay: ReplayResult
    dims: Dict[str, Dimension]
    candidates: List[Candidate]
    chosen: Candidate
    curve: List[Candidate]  # the optimum at each graph budget (for the plot)
    target: Optional[Target] = None
    fit: Optional[HbmFit] = None
    lowering_notes: List[str] = field(default_factory=list)


def tune(config: EngineConfig, trace: Sequence[TraceRequest], vocab_size: int, max_graphs: int,
         target: Optional[Target] = None, shape: Optional[ModelShape] = None,
         show_progress: bool = False) -> TuneReport:
    """Replay ``trace``, score the schemes, and choose the optimum under ``max_graphs`` model
    graphs (prefill + decode; the sampler's graphs come on top and are counted in ``graphs``)."""
    result = replay(replay_config(config), trace, vocab_size, step_cost=_arrival_clock(config, trace, target, shape),
                    show_progress=show_progress)
    dims = dimensions(result, config, row_multiple=8 if target else 1)
    candidates = [score("default", plan_of(config), config, dims)]
    candidates += [score(name, plan, config, dims) for name, plan in recipe_plans(dims).items()]
    budgets = range(2, max(max_graphs, 40) + 1)
    tables = optimal_tables(dims, budgets[-1])
    curve = [score(f"optimal@{b}", split_budget(dims, b, tables), config, dims) for b in budgets]
    chosen = score("optimal", split_budget(dims, max_graphs, tables), config, dims)
    report = TuneReport(list(trace), result, dims, candidates + [chosen], chosen, curve, target)
    if target is not None and shape is not None:
        _check_on_target(report, config, shape, show_progress)
    return report


def target_cost(shape: ModelShape, target: Target, tp: int, config: EngineConfig) -> CostModel:
    """The roofline of ``shape`` on ``target`` over ``tp`` chips, its layers' weights in the
    bytes its quantized checkpoint or ``config``'s quantization gives them (bf16 otherwise)."""
    weight_bytes = shape.checkpoint_weight_bytes or linear_bytes_per_weight(config.model.quantization)
    return CostModel(shape, target.chip, tp, weight_bytes=weight_bytes)


def _arrival_clock(config: EngineConfig, trace: Sequence[TraceRequest], target: Optional[Target],
                   shape: Optional[ModelShape]):
    """With arrival times and a target, the replay's clock advances by each step's roofline
    time (at the replay's top buckets), so requests join as they would on that slice; without
    either, every request arrives at once (the saturated case)."""
    if target is None or shape is None or any(r.arrival_s is None for r in trace):
        return None
    cost, bs = target_cost(shape, target, target.num_devices, config), config.cache.block_size

    def step_seconds(calls) -> float:
        return sum(cost.prefill_seconds(c.graph) if isinstance(c, PrefillCall) else
                   cost.decode_seconds(c.graph, bs, sum(c.needed_blocks) * bs / c.graph.num_rows) for c in calls)
    return step_seconds


def _check_on_target(report: TuneReport, config: EngineConfig, shape: ModelShape, show_progress: bool) -> None:
    """Lower the chosen buckets' kernels for the TPU (dropping any that fail), size the HBM,
    and estimate each candidate's throughput on the target."""
    target, tp = report.target, report.target.num_devices
    unsupported = kernel_support(shape, tp)
    if unsupported:
        report.lowering_notes.append(unsupported)
    else:
        _drop_unlowerable(report, config, shape, tp, show_progress)
    cost = target_cost(shape, target, tp, config)
    report.fit = hbm_fit(cost, config.scheduler.max_num_seqs, config.max_model_len,
                         report.chosen.plan.prefill[-1], config.cache.block_size, config.cache.memory_utilization)
    for candidate in report.candidates:
        seconds = estimated_seconds(report.replay, BucketPlan.from_config(with_buckets(config, candidate.plan)),
                                    cost, real_context=unsupported is None)
        candidate.tpu_tokens_per_s = report.replay.output_tokens / seconds if seconds else None


def _drop_unlowerable(report: TuneReport, config: EngineConfig, shape: ModelShape, tp: int,
                      show_progress: bool) -> None:
    chosen = report.chosen
    engine_plan = BucketPlan.from_config(with_buckets(config, chosen.plan))
    graphs = [g for g in engine_plan.graphs() if isinstance(g, (PrefillGraph, DecodeGraph))]
    results = lower_graphs(tqdm(graphs, desc="lowering kernels for TPU", disable=not show_progress), shape, tp,
                           config.cache.block_size, device_kind=report.target.device_kind)
    failed = [r for r in results if r.error]
    report.lowering_notes.append(f"{len(results) - len(failed)} of {len(results)} graphs' kernels lower for the TPU")
    bs, plan = config.cache.block_size, chosen.plan
    bad = {"prefill": set(), "rows": set(), "context": set()}
    for r in failed:
        report.lowering_notes.append(f"dropped: {r.kernel} at {r.graph}: {r.error}")
        if isinstance(r.graph, PrefillGraph):
            bad["prefill"].add(r.graph.num_tokens)
        elif r.graph.context_blocks * bs != plan.context[-1]:  # drop the narrower width first
            bad["context"].add(r.graph.context_blocks * bs)
        else:
            bad["rows"].add(r.graph.num_rows)
    kept = Plan(_keep_top(plan.prefill, bad["prefill"]), _keep_top(plan.rows, bad["rows"]),
                _keep_top(plan.context, bad["context"]))
    if kept != plan:
        report.chosen = score("optimal", kept, config, report.dims)
        report.candidates[-1] = report.chosen


def _keep_top(buckets: Sequence[int], bad: set) -> tuple:
    """``buckets`` without the ``bad`` ones; the top stays (it is the engine's limit), and if
    its kernel fails the engine cannot serve this configuration on a TPU at all."""
    if buckets[-1] in bad:
        raise ValueError(f"the top bucket {buckets[-1]} does not lower for the TPU; see the notes above "
                         "and lower max_num_batched_tokens / max_model_len or change block_size")
    return tuple(b for b in buckets if b not in bad)
