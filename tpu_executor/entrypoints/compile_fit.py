"""Sizing a compile's KV cache so that every graph of the plan fits beside it, per chip.

The cache's shape is an input of most graphs, so its block count is fixed before the plan is
compiled: the largest prefill and decode graphs are compiled over two small caches, and the
cache gets the HBM the line through their peaks leaves (and the prompt log-probs graph's
scratch, which is not probed). A graph of the plan that still finds no room beside it shrinks the
cache once, and the report says why.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Dict, Tuple

from tpu_executor.core.buckets import BucketPlan, DecodeGraph, PrefillGraph, PromptLogprobsGraph, graph_label
from tpu_executor.core.config import fit_max_model_len
from tpu_executor.core.tpu_slices import GIB
from tpu_executor.entrypoints.compile_figures import CompileReport, DoesNotFit, GraphFigures, _min_blocks, remedies

logger = logging.getLogger(__name__)


def compile_fitting(report: CompileReport, worker, model_steps_only: bool, show_progress: bool):
    """(records, the job kept or None): the plan compiled over ``report.num_blocks`` blocks. A
    graph the compiler finds out of HBM there (its own bytes beyond what the probes left) is
    probed alone and the cache shrinks to what it leaves; a graph that compiles but peaks over
    the usable HBM shrinks it by its excess. Once, as ``report.resized`` says, then the plan is
    compiled again (the cache's shape is an input of the model's graphs)."""
    from tpu_executor.worker.jax.graphs import GraphCompileError

    while True:
        report.max_model_len = _context_length(report)
        job = _keep_job(report, worker)
        graphs = _model_steps(report) if model_steps_only else None
        resizable = not report.resized and report.config.cache.num_blocks is None
        try:
            records = worker.compile_plan(report.num_blocks, report.max_model_len, show_progress, graphs=graphs)
        except GraphCompileError as err:
            out_of_memory = "RESOURCE_EXHAUSTED" in str(err)
            if not out_of_memory or not resizable:
                raise (DoesNotFit(_out_of_memory(report, err)) if out_of_memory else
                       ValueError(f"the TPU compiler refused the job for {report.target.name}: {err}")) from err
            _shrink_for(report, worker, err.label, show_progress)
            continue
        label, over = _over_usable(report, worker, records)
        fewer = report.num_blocks - -(-over // report.block_bytes)
        if over <= 0 or not resizable or fewer < _min_blocks(report.config):
            return records, job
        # Every block freed lowers every graph's peak by at least a block's bytes.
        _resize(report, fewer, f"graph '{label}' peaked {over / GIB:.2f} GiB over the usable HBM beside the "
                               f"{report.num_blocks} KV blocks the probes left; the cache shrank to {fewer} blocks")


def _resize(report: CompileReport, blocks: int, why: str) -> None:
    report.resized, report.num_blocks = why, blocks
    logger.warning("%s", why)


def _over_usable(report: CompileReport, worker, records) -> Tuple[str, int]:
    """(the graph with the highest peak, its bytes over the usable HBM) per chip."""
    resident = worker.resident()
    worst = max((GraphFigures.of(r, resident) for r in records), key=lambda g: g.peak)
    return worst.name, worst.peak - report.usable_bytes


def _shrink_for(report: CompileReport, worker, label: str, show_progress: bool) -> None:
    """Size the cache beside graph ``label`` (which ran out of HBM beside it) and say so."""
    graph = next((g for g in plan_at_context(report).graphs() if graph_label(g) == label), None)
    if graph is None:
        raise DoesNotFit(f"{report.target.name}: graph '{label}' does not fit beside {report.num_blocks} KV blocks. "
                         f"To fit: {remedies()}")
    name, blocks = _blocks_beside_graphs(report, worker, [graph], show_progress)
    blocks = min(blocks, report.num_blocks - 1)
    _resize(report, blocks, f"graph '{name}' did not fit beside the {report.num_blocks} KV blocks the largest "
                            f"graphs left; the cache shrank to the {blocks} blocks it leaves")


def blocks_that_fit(report: CompileReport, worker, show_progress: bool) -> int:
    """The blocks each chip's usable HBM holds beside the largest prefill and decode graphs
    (compiled over two small caches) and beside the prompt log-probs graph's scratch."""
    graphs = BucketPlan.from_config(report.config).graphs()
    blocks = _blocks_beside_graphs(report, worker, _largest_graphs(graphs), show_progress)[1]
    return min(blocks, _blocks_beside_prompt_logprobs(report, worker, graphs))


def _blocks_beside_prompt_logprobs(report: CompileReport, worker, graphs) -> int:
    """The blocks that leave the largest prompt log-probs graph room: its full-vocabulary fp32
    logits (tokens x vocabulary, its whole scratch as libtpu allocates it), its fp32 hidden
    states, 8 MiB for its code. Its warm-up runs a prefill first, so it is not probed alone
    like the model steps; a graph still over is caught after the compile (``compile_fitting``)."""
    prompt = [g for g in graphs if isinstance(g, PromptLogprobsGraph)]
    if not prompt:
        return 1 << 62  # no such graph: nothing to leave room for
    config, model_config = report.config, worker.model.config
    tokens = max(g.num_tokens for g in prompt)  # a prefill call's every hidden state gets its logits
    own = 4 * tokens * (model_config.vocab_size + model_config.hidden_size) + (8 << 20)
    worker.init_cache(_min_blocks(config), config.max_model_len)  # shapes only
    resident = worker.resident().bytes
    return int((report.usable_bytes - resident - own) // report.block_bytes) + _min_blocks(config)


def _blocks_beside_graphs(report: CompileReport, worker, graphs, show_progress: bool) -> Tuple[str, int]:
    """(the binding graph, the blocks that fit beside it): ``graphs`` compiled over a small cache
    and one a quarter of the room the first leaves. A graph's peak (with all that stays
    resident: the draft's weights, its KV cache and scratch blocks, the buffers) grows with the
    cache by at least a block of the target and one of the draft per block (more where a graph
    copies the cache), so the line through the two gives the blocks each chip's usable HBM holds
    beside each graph; the fewest bind. Probes far apart keep the compiler's alignment of small
    buffers out of the line's slope (two small caches made it 5% steeper than a block)."""
    config = report.config
    small = _min_blocks(config)
    peaks = [_probe_peaks(worker, small, graphs, show_progress)]
    room = (report.usable_bytes - max(peaks[0].values())) // report.block_bytes
    large = small + max(64, int(room // 4))
    peaks.append(_probe_peaks(worker, large, graphs, show_progress))

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
    return [g for g in plan_at_context(report).graphs() if isinstance(g, (PrefillGraph, DecodeGraph))]


def plan_at_context(report: CompileReport) -> BucketPlan:
    """The job's bucket plan at the context length its cache holds."""
    return BucketPlan.from_config(replace(report.config, max_model_len=report.max_model_len))


def _out_of_memory(report: CompileReport, err: Exception) -> str:
    """The compiler's own out-of-memory report, with what to change."""
    first = str(err).split("\n")[0]
    copies = ("; a graph whose ops fall back to their reference (see the kernel warnings) may copy the KV cache: "
              f"give --num-blocks below {report.num_blocks // 2}" if report.config.cache.num_blocks is None else "")
    return (f"{report.target.name}: {first}{copies}. To fit: {remedies()}")


def _largest_graphs(graphs) -> list:
    prefill = max((g for g in graphs if isinstance(g, PrefillGraph)), key=lambda g: (g.num_tokens, g.keys))
    decode = max((g for g in graphs if isinstance(g, DecodeGraph)), key=lambda g: (g.num_rows, g.context_blocks))
    return [prefill, decode]


def _context_length(report: CompileReport) -> int:
    """The context length the engine serves with ``report.num_blocks`` blocks (a default one is
    lowered to what they hold, as the TPU host's engine would)."""
    fitted = fit_max_model_len(report.config, report.num_blocks)
    return fitted.max_model_len
