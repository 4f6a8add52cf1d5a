"""One compile for a TPU slice: the engine config, the HBM fit, every graph of the plan
compiled by libtpu, the executables kept (``tpu-executor compile``).

Each chip holds, all the time, what stays resident (every model's weights, the draft model's
or EAGLE-3 head's too; the KV cache; the draft's KV cache with its scratch blocks; the
drafter's and the sampler's buffers), and, while a graph runs, that graph's own bytes (its
arguments that are not resident, its outputs not written in place, its scratch and its code).
A graph's peak is the sum, whether or not it takes the cache (a sampler, a drafter's graph).

The KV cache's shape is an input of most graphs, so its block count is fixed before the plan is
compiled: the largest prefill and decode graphs are compiled first over two small caches, and
the cache gets the HBM the line through their peaks leaves. The TPU host reuses that block
count and context length (they are in the job's manifest) instead of profiling; every graph of
the plan is then checked against the usable HBM, and the manifest is written only if all fit.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from tpu_executor.core.buckets import BucketPlan, DecodeGraph, PrefillGraph, graph_label
from tpu_executor.core.config import EngineConfig, fit_max_model_len, resolve_dtype
from tpu_executor.core.tpu_slices import GIB, Target

logger = logging.getLogger(__name__)


class DoesNotFit(ValueError):
    """The job cannot fit the slice's HBM; the message says by how much and what to change."""


@dataclass(frozen=True)
class GraphFigures:
    """One compiled graph as the compiler accounts it, per chip; ``inputs``: its arguments that
    do not stay resident, ``resident``: the bytes that stay beside it (``TargetWorker.resident``)."""

    name: str
    function: str
    compile_seconds: float
    arguments: int
    outputs: int
    temp: int
    code: int
    alias: int
    flops: float
    bytes_accessed: float
    pallas_kernels: Tuple[str, ...]
    providers: Tuple[Tuple[str, str], ...]  # (op, provider) of every op the graph calls
    inputs: int = 0
    resident: int = 0

    @property
    def peak(self) -> int:
        """Bytes live at once while it runs: what stays resident, its other inputs, its outputs
        not written in place, its scratch and its code."""
        return self.resident + self.inputs + self.outputs - self.alias + self.temp + self.code

    @classmethod
    def of(cls, record, resident) -> "GraphFigures":
        """``record`` (``graphs.CompileRecord``) beside ``resident`` (``target.Resident``)."""
        memory = record.compiled.memory_analysis()
        cost = record.compiled.cost_analysis() or {}
        cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
        kernels = record.program.kernels
        pallas = tuple(sorted({k.op for k in kernels if k.pallas}))
        return cls(record.label, record.function, record.seconds, memory.argument_size_in_bytes,
                   memory.output_size_in_bytes, memory.temp_size_in_bytes, memory.generated_code_size_in_bytes,
                   memory.alias_size_in_bytes, float(cost.get("flops", 0.0)),
                   float(cost.get("bytes accessed", 0.0)), pallas, tuple(sorted({(k.op, k.provider) for k in kernels})),
                   sum(size for tensor, size in record.inputs if tensor not in resident.state_ids), resident.bytes)


@dataclass
class CompileReport:
    """What ``compile_job`` found: the figures of every graph and the fit."""

    target: Target
    libtpu: str
    config: EngineConfig
    weight_bytes: int
    block_bytes: int
    usable_bytes: int
    num_blocks: int
    max_model_len: int
    draft_weight_bytes: int = 0  # the draft model's or EAGLE-3 head's share of weight_bytes
    resident_bytes: int = 0  # weights, KV caches and state at num_blocks (``TargetWorker.resident``)
    graphs: List[GraphFigures] = field(default_factory=list)
    kernel_warnings: List[str] = field(default_factory=list)
    weight_copies: List[str] = field(default_factory=list)  # ``weight_copies``
    resized: str = ""  # why the cache shrank below what the probes sized (``compile_fit``)
    job_path: Optional[str] = None

    @property
    def peak_graph(self) -> GraphFigures:
        return max(self.graphs, key=lambda g: g.peak)

    @property
    def peak_bytes(self) -> int:
        return self.peak_graph.peak if self.graphs else self.resident_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    @property
    def verdict(self) -> str:
        if self.fits:
            return "fits"
        over = self.peak_bytes - self.usable_bytes
        return (f"does not fit: graph '{self.peak_graph.name}' needs {self.peak_bytes / GIB:.2f} GiB per chip "
                f"({self.resident_bytes / GIB:.2f} GiB of it resident), {over / GIB:.2f} GiB ({over} bytes) over the "
                f"{self.usable_bytes / GIB:.2f} GiB usable; " + remedies() + self._fewer_blocks(over))

    def _fewer_blocks(self, over: int) -> str:
        """``, or --num-blocks N``: a cache that leaves the graph room, where one is long enough."""
        blocks = self.num_blocks - -(-over // max(1, self.block_bytes))
        return f", or --num-blocks {blocks}" if blocks >= _min_blocks(self.config) else ""


def remedies() -> str:
    return ("lower --max-num-seqs or --max-model-len or the largest bucket, use more chips (a larger --target), "
            "or --quantization int8")


def engine_config(checkpoint: str, target: Target, options: Dict[str, Any], platform: str = "tpu") -> EngineConfig:
    """The JAX path's config for ``target``: ``dtype="auto"`` as on its platform (bf16 on a
    TPU), tensor parallelism over the slice's chips unless given."""
    from tpu_executor.engine.options import build_engine_config

    options = {name: value for name, value in options.items() if name != "device"}  # the JAX path's, always
    options["dtype"] = resolve_dtype(options.get("dtype", "auto"), None, platform)
    options.setdefault("tensor_parallel_size", target.num_chips)
    tp = options["tensor_parallel_size"]
    if target.num_chips % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide {target.name}'s {target.num_chips} chips")
    return build_engine_config(checkpoint, device="jax", **options)


def compile_job(checkpoint: str, target: Target, options: Dict[str, Any], show_progress: bool = True,
                devices: Optional[List] = None, model_steps_only: bool = False) -> CompileReport:
    """Compile the plan of ``options`` for ``target``; keep the executables in the config's
    cache directory when the job fits. Raises DoesNotFit before compiling anything when the
    weights alone (with one sequence's KV cache) exceed a chip's usable HBM. ``devices``: other
    devices to compile for than the slice's (this process's CPU devices prove the load path
    here, with the slice's HBM figures). ``model_steps_only``: the prefill and decode graphs
    alone (the fit's; the host compiles the rest)."""
    from tpu_executor.entrypoints.compile_fit import blocks_that_fit, compile_fitting
    from tpu_executor.worker.jax.runtime import libtpu_version
    from tpu_executor.worker.jax.target import target_devices

    devices = list(devices) if devices is not None else target_devices(target)
    config = engine_config(checkpoint, target, options, devices[0].platform)
    devices = devices[:config.parallel.tensor_parallel_size]
    worker = _shapes_worker(config, devices)
    report = _empty_report(config, target, worker, libtpu_version())
    _refuse_early(report, worker)
    report.num_blocks = config.cache.num_blocks or blocks_that_fit(report, worker, show_progress)
    records, job = compile_fitting(report, worker, model_steps_only, show_progress)
    resident = worker.resident()
    report.resident_bytes = resident.bytes
    report.graphs = [GraphFigures.of(r, resident) for r in in_plan_order(records, worker.runner.plan)]
    report.kernel_warnings = kernel_warnings(records)
    report.weight_copies = weight_copies(records, worker)
    if job is not None and report.fits:
        job.write_manifest(worker.jax)
    return report


def _keep_job(report: CompileReport, worker):
    """The AOT job the compile writes into (None without a cache directory)."""
    from tpu_executor.kernels.registry import REGISTRY
    from tpu_executor.worker.jax.aot import AotJob, job_parts

    config = report.config
    if config.compile.cache_dir is None:
        return None
    parts = job_parts(config, worker.jax, REGISTRY.fingerprint(jax_path=True))
    job = AotJob.create(config.compile.cache_dir, parts, report.num_blocks, report.max_model_len, report.target.name)
    worker.keep_in(job)
    report.job_path = job.path
    return job


def _model_steps(report: CompileReport) -> list:
    """The prefill and decode graphs alone, of the plan at the context length the cache holds
    (``--model-steps-only``: the fit's; the host compiles the rest)."""
    plan = BucketPlan.from_config(replace(report.config, max_model_len=report.max_model_len))
    return [g for g in plan.graphs() if isinstance(g, (PrefillGraph, DecodeGraph))]


def _out_of_memory(report: CompileReport, err: Exception) -> str:
    """The compiler's own out-of-memory report, with what to change."""
    first = str(err).split("\n")[0]
    copies = ("; a graph whose ops fall back to their reference (see the kernel warnings) may copy the KV cache: "
              f"give --num-blocks below {report.num_blocks // 2}" if report.config.cache.num_blocks is None else "")
    return (f"{report.target.name}: {first}{copies}. To fit: {remedies()}")


def _shapes_worker(config: EngineConfig, devices):
    """A started worker of the slice with the model's shapes placed (its runner is replaced
    when the cache is allocated)."""
    from tpu_executor.worker.jax.target import TargetWorker

    worker = TargetWorker(config, devices)
    worker.init_device()
    worker.load_model()
    return worker


def _empty_report(config: EngineConfig, target: Target, worker, libtpu: str) -> CompileReport:
    usable = int(target.chip.hbm_bytes * config.cache.memory_utilization)
    return CompileReport(target, libtpu, config, worker.weight_bytes, worker.cache_block_bytes_per_chip(), usable,
                         num_blocks=0, max_model_len=config.max_model_len,
                         draft_weight_bytes=worker.draft_weight_bytes_per_chip())


def _min_blocks(config: EngineConfig) -> int:
    """The fewest blocks a job may run with: one sequence of the context length the user set
    (a default one is lowered to what fits), plus the null block."""
    return config.max_blocks_per_seq + 1 if config.model.max_model_len is not None else 2


def _refuse_early(report: CompileReport, worker) -> None:
    """Refuse, before anything compiles, a job whose resident bytes alone (weights, the fewest
    KV blocks it may run with, the drafter's and the sampler's buffers) exceed a chip's usable HBM."""
    config = report.config
    blocks = _min_blocks(config)
    worker.init_cache(blocks, config.max_model_len)  # shapes only: nothing is allocated
    needed = worker.resident().bytes
    if needed > report.usable_bytes:
        over = needed - report.usable_bytes
        larger = _larger_slice(report, needed)
        draft = f" ({report.draft_weight_bytes / GIB:.2f} GiB the drafter's)" if report.draft_weight_bytes else ""
        raise DoesNotFit(
            f"{report.target.name}: the weights take {report.weight_bytes / GIB:.2f} GiB per chip{draft}, and "
            f"{blocks} KV blocks with {state_holders(report)} {(needed - report.weight_bytes) / GIB:.2f} GiB: "
            f"{over / GIB:.2f} GiB over the {report.usable_bytes / GIB:.2f} GiB usable of each chip's "
            f"{report.target.chip.hbm_bytes / GIB:.1f} GiB (memory_utilization {config.cache.memory_utilization}); "
            f"nothing was compiled. To fit: use more chips{larger} or --quantization int8"
            + (", or a shorter --max-model-len" if config.model.max_model_len is not None else ""))


def state_holders(report: CompileReport) -> str:
    """Who keeps device state beside the KV cache, as messages name them."""
    return "the sampler's and the drafter's state" if report.draft_weight_bytes else "the sampler's state"


def _larger_slice(report: CompileReport, needed_per_chip: int) -> str:
    """`` (e.g. --target v6e-8)``: the smallest slice of the same chips whose share would fit,
    counting every byte as split over the chips (replicated ones make it a lower bound)."""
    from tpu_executor.core.tpu_slices import GRIDS_2D, GRIDS_3D

    target = report.target
    total = needed_per_chip * report.config.parallel.tensor_parallel_size
    for chips in sorted(GRIDS_3D if target.is_3d else GRIDS_2D):
        if chips > target.num_chips and total / chips <= report.usable_bytes:
            return f" (at least --target {Target(target.chip, chips).name})"
    return ""


def _largest_graphs(graphs) -> list:
    prefill = max((g for g in graphs if isinstance(g, PrefillGraph)), key=lambda g: (g.num_tokens, g.keys))
    decode = max((g for g in graphs if isinstance(g, DecodeGraph)), key=lambda g: (g.num_rows, g.context_blocks))
    return [prefill, decode]


def _context_length(report: CompileReport) -> int:
    """The context length the engine serves with ``report.num_blocks`` blocks (a default one is
    lowered to what they hold, as the TPU host's engine would)."""
    fitted = fit_max_model_len(report.config, report.num_blocks)
    return fitted.max_model_len


def in_plan_order(records, plan) -> list:
    """Compile records (in the order they finished) in the order of the plan's graphs."""
    order = {graph_label(g): i for i, g in enumerate(plan.graphs())}
    return sorted(records, key=lambda r: order.get(r.label, len(order)))


def kernel_warnings(records) -> List[str]:
    """Where a Pallas kernel refused a bucket's shapes (``worker.jax.programs.refusal_lines``)."""
    from tpu_executor.worker.jax.programs import refusal_lines

    return refusal_lines(choice for record in records for choice in record.program.kernels)


def weight_copies(records, worker) -> List[str]:
    """``"<graph>: <buffer>"`` for every buffer of a weight's shape a graph allocates
    (``hlo_audit``): a copy of that weight made at every step."""
    from tpu_executor.worker.jax.hlo_audit import weight_shapes_per_chip, weight_sized_buffers

    models = [worker.model] + ([worker.drafter.model] if worker.drafter is not None else [])
    shapes = {key: name for model in models for key, name in weight_shapes_per_chip(model).items()}
    return [f"{record.label}: {buffer}" for record in records
            for buffer in weight_sized_buffers(record.compiled.as_text(), shapes)]
