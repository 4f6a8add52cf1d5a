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
from typing import Any, Dict, List, Optional

from tpu_executor.core.buckets import graph_label
from tpu_executor.core.config import EngineConfig, resolve_dtype
from tpu_executor.core.tpu_slices import GIB, Target
from tpu_executor.entrypoints.compile_figures import (
    CompileReport,
    DoesNotFit,
    GraphFigures,
    _min_blocks,
    remedies,
    state_holders,
)
from tpu_executor.entrypoints.compile_fit import blocks_that_fit, compile_fitting

logger = logging.getLogger(__name__)
__all__ = ["CompileReport", "DoesNotFit", "GraphFigures", "compile_job", "engine_config", "remedies", "state_holders"]


def engine_config(checkpoint: str, target: Target, options: Dict[str, Any], platform: str = "tpu") -> EngineConfig:
    """The JAX path's config for ``target``: ``dtype="auto"`` as on its platform (bf16 on a
    TPU), tensor parallelism over the slice's devices unless given."""
    from tpu_executor.engine.options import build_engine_config

    options = {name: value for name, value in options.items() if name != "device"}  # the JAX path's, always
    options["dtype"] = resolve_dtype(options.get("dtype", "auto"), None, platform)
    options.setdefault("tensor_parallel_size", target.num_devices)
    tp = options["tensor_parallel_size"]
    if target.num_devices % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide {target.name}'s {target.num_devices} devices")
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
    worker = shapes_worker(config, devices)
    report = _empty_report(config, target, worker, libtpu_version())
    _refuse_early(report, worker)
    report.num_blocks = config.cache.num_blocks or blocks_that_fit(report, worker, show_progress)
    records, job = compile_fitting(report, worker, model_steps_only, show_progress)
    report.compile_threads = worker.runner.compile_threads
    resident = worker.resident()
    report.resident_bytes = resident.bytes
    records = in_plan_order(records, worker.runner.plan)
    texts = [r.compiled.as_text() for r in records]  # read once: the HBM bytes and the copy audit
    report.graphs = [GraphFigures.of(r, resident, text) for r, text in zip(records, texts)]
    report.kernel_warnings = kernel_warnings(records)
    report.weight_copies = weight_copies(records, worker, texts)
    if job is not None and report.fits:
        job.write_manifest(worker.jax)
    return report


def shapes_worker(config: EngineConfig, devices):
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


def _larger_slice(report: CompileReport, needed_per_chip: int) -> str:
    """`` (e.g. --target v6e-8)``: the smallest slice of the same chips whose share would fit,
    counting every byte as split over the chips (replicated ones make it a lower bound)."""
    from tpu_executor.core.tpu_slices import GRIDS_2D, GRIDS_3D

    target = report.target
    total = needed_per_chip * report.config.parallel.tensor_parallel_size
    for chips in sorted(GRIDS_3D if target.is_3d else GRIDS_2D):
        larger = Target(target.chip, chips)
        if chips > target.num_chips and total / larger.num_devices <= report.usable_bytes:
            return f" (at least --target {larger.name})"
    return ""


def in_plan_order(records, plan) -> list:
    """Compile records (in the order they finished) in the order of the plan's graphs."""
    order = {graph_label(g): i for i, g in enumerate(plan.graphs())}
    return sorted(records, key=lambda r: order.get(r.label, len(order)))


def kernel_warnings(records) -> List[str]:
    """Where a Pallas kernel refused a bucket's shapes (``worker.jax.programs.refusal_lines``)."""
    from tpu_executor.worker.jax.programs import refusal_lines

    return refusal_lines(choice for record in records for choice in record.program.kernels)


def weight_copies(records, worker, texts: Optional[List[str]] = None) -> List[str]:
    """``"<graph>: <buffer>"`` for every buffer of a weight's shape a graph allocates
    (``hlo_audit``): a copy of that weight made at every step. ``texts``: the records'
    compiled texts, where the caller has read them."""
    from tpu_executor.worker.jax.hlo_audit import weight_shapes_per_chip, weight_sized_buffers

    models = [worker.model] + ([worker.drafter.model] if worker.drafter is not None else [])
    shapes = {key: name for model in models for key, name in weight_shapes_per_chip(model).items()}
    texts = texts if texts is not None else [record.compiled.as_text() for record in records]
    return [f"{record.label}: {buffer}" for record, text in zip(records, texts)
            for buffer in weight_sized_buffers(text, shapes)]
