"""What ``tpu-executor compile`` prints and writes: a table of the compiled graphs (compile
seconds, HBM per chip, the compiler's FLOPs and bytes, Pallas kernels), the HBM fit, and the
same facts as JSON."""
from __future__ import annotations

from typing import Dict, List

from tpu_executor.core.tpu_slices import GIB, Chip
from tpu_executor.entrypoints.compile_figures import CompileReport, GraphFigures, state_holders

MIB = 1 << 20
COLUMNS = ("graph", "compile s", "args MiB", "out MiB", "temp MiB", "code MiB", "peak GiB", "GFLOP", "HBM GB",
           "floor ms", "Pallas kernels")


def floor_seconds(graph: GraphFigures, chip: Chip) -> float:
    """The step's roofline from the compiler's own counts: its HBM bytes at the chip's HBM
    bandwidth or its FLOPs at peak, whichever is longer. A lower bound on the step's time, not
    a prediction (the kernels' bytes are their cost estimates; no overlap is perfect)."""
    return max(graph.hbm_bytes / chip.hbm_bytes_per_s, graph.flops / chip.peak_flops)


def _row(graph: GraphFigures, chip: Chip) -> List[str]:
    return [graph.name, f"{graph.compile_seconds:.1f}", f"{graph.arguments / MIB:.1f}", f"{graph.outputs / MIB:.1f}",
            f"{graph.temp / MIB:.1f}", f"{graph.code / MIB:.2f}", f"{graph.peak / GIB:.2f}", f"{graph.flops / 1e9:.3g}",
            f"{graph.hbm_bytes / 1e9:.3g}", f"{floor_seconds(graph, chip) * 1e3:.3g}",
            ", ".join(graph.pallas_kernels) or "-"]


def print_table(graphs: List[GraphFigures], chip: Chip) -> None:
    """One row per graph; ``floor ms``: ``floor_seconds`` on ``chip``."""
    rows = [_row(g, chip) for g in graphs]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    for line in [list(COLUMNS)] + rows:
        print("  ".join(cell.ljust(width) if i in (0, len(COLUMNS) - 1) else cell.rjust(width)
                        for i, (cell, width) in enumerate(zip(line, widths))))


def print_report(report: CompileReport, wall_seconds: float) -> None:
    """The table, the kernel warnings, the fit and where the executables went."""
    print_table(report.graphs, report.target.chip)
    chip = report.target.chip
    print("HBM GB: the compiler's bytes accessed less its own moves between HBM and VMEM counted beyond the one "
          f"access each is; floor ms: those bytes at {chip.hbm_bytes_per_s / 1e9:.0f} GB/s of HBM (or its FLOPs "
          f"at {chip.peak_flops / 1e12:.0f} TFLOP/s), a lower bound on a step's time per {report.target.device_noun}")
    for line in report.kernel_warnings:
        print(f"warning: Pallas kernel refused: {line}")
    if report.resized:
        print(f"warning: {report.resized}")
    for line in report.weight_copies:
        print(f"warning: a weight-sized buffer, copied at every step: {line}")
    target, config = report.target, report.config
    compile_seconds = sum(g.compile_seconds for g in report.graphs)
    print(f"{len(report.graphs)} graphs compiled by libtpu {report.libtpu} for {target.name} "
          f"({target.topology_name}, {target.num_hosts} host(s), tensor_parallel_size "
          f"{config.parallel.tensor_parallel_size}, {config.model.dtype}) in {wall_seconds:.0f} s "
          f"({compile_seconds:.0f} s of compiler time, {report.compile_threads} graph(s) at a time)")
    draft = f" (the drafter's {report.draft_weight_bytes / GIB:.2f} GiB)" if report.draft_weight_bytes else ""
    print(f"per {target.device_noun}: weights {report.weight_bytes / GIB:.2f} GiB{draft} + KV cache "
          f"{report.num_blocks} blocks x {report.block_bytes / MIB:.2f} MiB = "
          f"{report.num_blocks * report.block_bytes / GIB:.2f} GiB; resident with {state_holders(report)} "
          f"{report.resident_bytes / GIB:.2f} GiB; "
          f"peak {report.peak_bytes / GIB:.2f} GiB in '{report.peak_graph.name}' of "
          f"{report.usable_bytes / GIB:.2f} GiB usable ({config.cache.memory_utilization:.0%} of "
          f"{target.chip.hbm_bytes / GIB:.1f} GiB HBM): {report.verdict}")
    full = (report.num_blocks - 1) // -(-report.max_model_len // config.cache.block_size)
    print(f"serves a context of {report.max_model_len} tokens, {min(full, config.scheduler.max_num_seqs)} "
          f"full-length sequences at once of max_num_seqs {config.scheduler.max_num_seqs} "
          f"({(report.num_blocks - 1) * config.cache.block_size} tokens of KV cache)")
    if report.job_path and report.fits:
        print(f"executables: {report.job_path}; on the {target.name} host (libtpu {report.libtpu}), with the "
              f"engine options given here: tpu-executor serve CHECKPOINT --device jax --cache-dir "
              f"{config.compile.cache_dir} --tensor-parallel-size {config.parallel.tensor_parallel_size}")


def report_json(report: CompileReport) -> Dict:
    """The report's facts under stable keys."""
    return {
        "target": report.target.name, "topology": report.target.topology_name, "libtpu": report.libtpu,
        "fits": report.fits, "hbm_per_chip_bytes": int(report.target.chip.hbm_bytes),
        "usable_bytes_per_chip": report.usable_bytes, "peak_bytes_per_chip": report.peak_bytes,
        "weight_bytes_per_chip": report.weight_bytes, "draft_weight_bytes_per_chip": report.draft_weight_bytes,
        "resident_bytes_per_chip": report.resident_bytes, "kv_cache_blocks": report.num_blocks,
        "kv_block_bytes_per_chip": report.block_bytes, "max_model_len": report.max_model_len,
        "tensor_parallel_size": report.config.parallel.tensor_parallel_size, "dtype": report.config.model.dtype,
        "executables": report.job_path if report.fits else None, "kernel_warnings": report.kernel_warnings,
        "weight_copies": report.weight_copies, "kv_cache_resized": report.resized or None,
        "compile_threads": report.compile_threads,
        "graphs": [{"name": g.name, "function": g.function, "compile_seconds": g.compile_seconds,
                    "hbm": {"arguments": g.arguments, "outputs": g.outputs, "temp": g.temp, "code": g.code},
                    "peak_bytes": g.peak, "floor_seconds": floor_seconds(g, report.target.chip),
                    "flops": g.flops, "bytes_accessed": g.bytes_accessed, "hbm_bytes": g.hbm_bytes,
                    "pallas_kernels": list(g.pallas_kernels),
                    "providers": dict(g.providers)}
                   for g in report.graphs],
    }
