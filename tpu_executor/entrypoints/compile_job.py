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
    resized: str = ""  # why the cache shrank below what the probes sized (``_compile_fitting``)
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
    from tpu_executor.worker.jax.runtime import libtpu_version
    from tpu_executor.worker.jax.target import target_devices

    devices = list(devices) if devices is not None else target_devices(target)
    config = engine_config(checkpoint, target, options, devices[0].platform)
    devices = devices[:config.parallel.tensor_parallel_size]
    worker = _shapes_worker(config, devices)
    report = _empty_report(config, target, worker, libtpu_version())
    _refuse_early(report, worker)
    report.num_blocks = config.cache.num_blocks or _blocks_that_fit(report, worker, show_progress)
    records, job = _compile_fitting(report, worker, model_steps_only, show_progress)
    resident = worker.resident()
    report.resident_bytes = resident.bytes
    report.graphs = [GraphFigures.of(r, resident) for r in in_plan_order(records, worker.runner.plan)]
    report.kernel_warnings = kernel_warnings(records)
    report.weight_copies = weight_copies(records, worker)
    if job is not None and report.fits:
        job.write_manifest(worker.jax)
    return report


def _compile_fitting(report: CompileReport, worker, model_steps_only: bool, show_progress: bool):
    """(records, the job kept or None): the plan compiled over ``report.num_blocks`` blocks. A
    graph the compiler finds out of HBM there (its own bytes beyond what the probes left) is
    probed alone, and the cache shrinks to what it leaves, once, as ``report.resized`` says."""
    from tpu_executor.worker.jax.graphs import GraphCompileError

    while True:
        report.max_model_len = _context_length(report)
        job = _keep_job(report, worker)
        graphs = _model_steps(report) if model_steps_only else None
        try:
            return worker.compile_plan(report.num_blocks, report.max_model_len, show_progress, graphs=graphs), job
        except GraphCompileError as err:
            out_of_memory = "RESOURCE_EXHAUSTED" in str(err)
            if not out_of_memory or report.resized or report.config.cache.num_blocks is not None:
                raise (DoesNotFit(_out_of_memory(report, err)) if out_of_memory else
                       ValueError(f"the TPU compiler refused the job for {report.target.name}: {err}")) from err
            _shrink_for(report, worker, err.label, show_progress)


def _shrink_for(report: CompileReport, worker, label: str, show_progress: bool) -> None:
    """Size the cache beside graph ``label`` (which ran out of HBM beside it) and say so."""
    plan = BucketPlan.from_config(replace(report.config, max_model_len=report.max_model_len))
    graph = next((g for g in plan.graphs() if graph_label(g) == label), None)
    if graph is None:
        raise DoesNotFit(f"{report.target.name}: graph '{label}' does not fit beside {report.num_blocks} KV blocks. "
                         f"To fit: {remedies()}")
    name, blocks = _blocks_beside_graphs(report, worker, [graph], show_progress)
    blocks = min(blocks, report.num_blocks - 1)
    report.resized = (f"graph '{name}' did not fit beside the {report.num_blocks} KV blocks the largest graphs "
                      f"left; the cache shrank to the {blocks} blocks it leaves")
    logger.warning("%s", report.resized)
    report.num_blocks = blocks


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


def _blocks_that_fit(report: CompileReport, worker, show_progress: bool) -> int:
    """The blocks each chip's usable HBM holds beside the largest prefill and decode graphs."""
    return _blocks_beside_graphs(report, worker, _largest_graphs(BucketPlan.from_config(report.config).graphs()),
                                 show_progress)[1]


def _blocks_beside_graphs(report: CompileReport, worker, graphs, show_progress: bool) -> Tuple[str, int]:
    """(the binding graph, the blocks that fit beside it): ``graphs`` compiled over two small
    caches. A graph's peak (with all that stays resident: the draft's weights, its KV cache and
    scratch blocks, the buffers) grows with the cache by at least a block of the target and one
    of the draft per block (more where a graph copies the cache), so the line through the two
    gives the blocks each chip's usable HBM holds beside each graph; the fewest bind."""
    config = report.config
    small, large = _min_blocks(config), 2 * _min_blocks(config) + 64
    peaks = [_probe_peaks(worker, blocks, graphs, show_progress) for blocks in (small, large)]

    def blocks_beside(name: str) -> int:
        per_block = max(report.block_bytes, (peaks[1][name] - peaks[0][name]) / (large - small))
        return int((report.usable_bytes - peaks[0][name]) // per_block) + small

    name = min(peaks[0], key=blocks_beside)
    if blocks_beside(name) < _min_blocks(config):
        over = int(peaks[0][name] - report.usable_bytes)
        raise DoesNotFit(f"{report.target.name}: graph '{name}' with the weights leaves no room for "
                         f"{_min_blocks(config)} KV blocks: {over / GIB:.2f} GiB ({over} bytes) over the "
                         f"{report.usable_bytes / GIB:.2f} GiB usable per chip. To fit: {remedies()}")
    return name, blocks_beside(name)


def _probe_peaks(worker, blocks: int, graphs, show_progress: bool) -> Dict[str, int]:
    """{graph: peak bytes per chip} of ``graphs`` compiled over a cache of ``blocks`` blocks (on
    the job's worker before it keeps anything: these executables are not the job's)."""
    records = worker.compile_plan(blocks, worker.config.max_model_len, show_progress, graphs=graphs)
    resident = worker.resident()
    return {r.label: GraphFigures.of(r, resident).peak for r in records}


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
