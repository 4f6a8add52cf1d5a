"""``tpu-executor tune``: choose bucket sizes from a request-length trace under a graph budget,
and size a TPU job before renting it.

    tpu-executor tune --trace requests.jsonl --model /ckpt --max-graphs 24 --out buckets.json
    tpu-executor tune --trace sharegpt-like --model llama-3-8b --target v5e-8 --plot tuning.png
    tpu-executor serve /ckpt --bucket-config buckets.json      # and LLM(..., bucket_config=...)

The trace (a file: JSONL/CSV lengths, Azure, BurstGPT, Mooncake, ShareGPT; or a synthetic
name: sharegpt-like, chat, long-prompt) is replayed through the real scheduler and bucket plan
on a null device; every scheme's buckets are scored on the sizes the runner saw; the optimum
under ``--max-graphs`` model graphs (prefill + decode; the sampler's small graphs are counted
apart) is written with ``--out``. ``--measure N`` runs the default and the chosen buckets on
the first N requests in the real engine here. ``--target`` adds a roofline estimate on a TPU
slice, the HBM fit, and lowers every chosen bucket's Pallas kernels for the TPU. ``--model``
may name a published config (``tools/published_models.py``) when the weights are not here.
"""
from __future__ import annotations

import argparse
import csv
import json
from dataclasses import asdict
from typing import Dict, List, Optional

from tpu_executor.core.bucket_file import write_bucket_file
from tpu_executor.engine.options import (
    HelpFormatter,
    add_engine_arguments,
    build_engine_config,
    engine_options_from_args,
)
from tpu_executor.tools.published_models import MODEL_SHAPES

COLUMNS = ("scheme", "model graphs", "all graphs", "prefill waste", "rows waste", "context waste",
           "worst waste", "est. warm-up s", "TPU est. tok/s", "here: sample tok/s", "here: trace tok/s")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("tune", help="choose bucket sizes from a length trace",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--trace", required=True, help="trace file, or sharegpt-like | chat | long-prompt")
    parser.add_argument("--model", default=None, help="checkpoint directory, or a published model's shapes "
                                                      f"(no weights needed): {', '.join(MODEL_SHAPES)} "
                                                      "(default: the default model)")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests (synthetic: 1000)")
    parser.add_argument("--max-graphs", type=int, default=24, help="model graphs (prefill + decode) to compile")
    parser.add_argument("--target", default=None, help="TPU slice to estimate and lower for, e.g. v5e-8")
    parser.add_argument("--compile", action="store_true",
                        help="with --target: compile the chosen plan for the slice with libtpu and print the "
                             "compiler's per-chip HBM beside the roofline's estimate")
    parser.add_argument("--measure", type=int, default=32, metavar="N",
                        help="run default and chosen buckets on the first N requests here (0: skip)")
    parser.add_argument("--out", default=None, help="write the chosen buckets here (a bucket file)")
    parser.add_argument("--csv", default=None, help="write the table as CSV")
    parser.add_argument("--json", default=None, help="write the full report as JSON")
    parser.add_argument("--plot", default=None, help="draw waste and warm-up versus graphs (PNG)")
    add_engine_arguments(parser, why="The limits to tune for (each dimension's top bucket), and the engine "
                                     "--measure runs.")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from tpu_executor.tuning.traces import TraceError

    try:
        _run(args)
    except (TraceError, ValueError) as err:
        raise SystemExit(f"tpu-executor tune: {err}") from None


def _run(args: argparse.Namespace) -> None:
    from tpu_executor.tools.default_model import prepare
    from tpu_executor.tools.published_models import model_directory
    from tpu_executor.tuning.roofline import ModelShape, Target
    from tpu_executor.tuning.traces import load_trace
    from tpu_executor.tuning.tuner import tune
    from tpu_executor.worker.model_loader import load_hf_config

    options = engine_options_from_args(args)
    target = Target.parse(args.target) if args.target else None
    with model_directory(args.model or prepare()) as model_dir:
        config = build_engine_config(model_dir, **options)
        hf = load_hf_config(model_dir)
        shape = ModelShape.from_hf_config(hf)
        trace = load_trace(args.trace, _tokenizer(model_dir, args.trace), args.num_requests,
                           config.max_model_len, config.model.seed)
        report = tune(config, trace, hf.vocab_size, args.max_graphs, target, shape, show_progress=True)
        measured = _measure(args, model_dir, config, options, report, shape)
        compiled = _compile_chosen(args, model_dir, options, report, shape)
    rows = [_row(c, measured, seconds_per_graph(measured)) for c in report.candidates]
    _print_report(report, rows, measured, args)
    _print_compiled(compiled)
    _write_outputs(args, config, report, rows, measured, compiled)


def _tokenizer(model_dir: str, trace: str):
    """The model's tokenizer for a ShareGPT trace (None when not needed or not there)."""
    if not trace.endswith(".json"):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def _measure(args, model_dir: str, config, options: Dict, report, shape) -> Dict:
    """Default and chosen buckets in the real engine on the first ``--measure`` requests, and
    the cost model held against a few of the chosen buckets' step times."""
    import glob

    from tpu_executor.tuning.measure import measure_finalists

    if args.measure <= 0 or not glob.glob(f"{model_dir}/*.safetensors"):
        return {"note": "not measured (--measure 0, or no weights for this model here)"}
    sample = report.trace[:args.measure]
    if len(sample) < 4 * config.scheduler.max_num_seqs:
        print(f"warning: --measure {len(sample)} requests cannot keep max_num_seqs sequences running for long: "
              "the sample's batches are smaller than the trace's, so its throughput does not judge buckets "
              "fitted to the whole trace (use at least 4 x max_num_seqs)")
    finalists = [(c.name, c.plan) for c in (report.candidates[0], report.chosen)]
    runs, checks = measure_finalists(model_dir, options, finalists, sample, report.replay, shape)
    return {"runs": runs, "checks": checks, "requests": len(sample)}


def _compile_chosen(args, model_dir: str, options: Dict, report, shape) -> Optional[Dict]:
    """The chosen plan compiled for ``--target`` by libtpu (``--compile``): the compiler's
    per-chip figures beside the roofline's, or why it does not fit."""
    if not args.compile:
        return None
    if report.target is None:
        raise ValueError("--compile needs --target: the slice to compile for")
    from tpu_executor.entrypoints.compile_job import compile_job

    plan_options = {**options, **report.chosen.plan.options(), "cache_dir": None}
    try:
        compiled = compile_job(model_dir, report.target, plan_options)
    except ValueError as err:
        return {"fits": False, "error": str(err)}
    fit = report.fit
    peak = compiled.peak_graph
    return {"fits": compiled.fits, "graphs": len(compiled.graphs),
            "weight_bytes": [compiled.weight_bytes, fit.weight_bytes],
            "graph_bytes_beside_weights_and_kv": [peak.peak - compiled.weight_bytes
                                                  - compiled.num_blocks * compiled.block_bytes, fit.activation_bytes],
            "kv_blocks": [compiled.num_blocks, fit.max_kv_blocks], "peak_graph": peak.name,
            "compile_seconds": sum(g.compile_seconds for g in compiled.graphs),
            "step_seconds": _step_floors(compiled, shape)}


def _step_floors(compiled, shape) -> List[List]:
    """``[graph, the compiler's floor, the cost model's roofline]`` (seconds) per model step:
    the floor from the compiler's HBM bytes and FLOPs (``compile_report.floor_seconds``), the
    roofline from the model's shape as ``tune`` ranks buckets with it. Both lower bounds."""
    from tpu_executor.core.buckets import DecodeGraph, PrefillGraph, graph_label
    from tpu_executor.entrypoints.compile_fit import plan_at_context
    from tpu_executor.entrypoints.compile_report import floor_seconds
    from tpu_executor.tuning.tuner import target_cost

    config = compiled.config
    cost = target_cost(shape, compiled.target, config.parallel.tensor_parallel_size, config)
    plan = plan_at_context(compiled)
    by_label = {graph_label(g): g for g in plan.graphs() if isinstance(g, (PrefillGraph, DecodeGraph))}
    rows = []
    for figures in compiled.graphs:
        graph = by_label.get(figures.name)
        if graph is not None:
            estimate = (cost.prefill_seconds(graph) if isinstance(graph, PrefillGraph)
                        else cost.decode_seconds(graph, config.cache.block_size))
            rows.append([figures.name, floor_seconds(figures, compiled.target.chip), estimate])
    return rows


def _print_compiled(compiled: Optional[Dict]) -> None:
    if compiled is None:
        return
    if "error" in compiled:
        print(f"compiled with libtpu: {compiled['error']}")
        return
    gib = 1 << 30
    pairs = " ; ".join(f"{name.replace('_', ' ')} {compiled[name][0] / gib:.2f} vs {compiled[name][1] / gib:.2f} GiB"
                       for name in ("weight_bytes", "graph_bytes_beside_weights_and_kv"))
    print(f"compiled with libtpu ({compiled['graphs']} graphs, {compiled['compile_seconds']:.0f} s), compiler vs "
          f"roofline per chip: {pairs}; KV blocks that fit {compiled['kv_blocks'][0]} vs {compiled['kv_blocks'][1]} "
          f"(largest graph: {compiled['peak_graph']}): {'fits' if compiled['fits'] else 'DOES NOT FIT'}")
    for name, floor, roofline in compiled["step_seconds"]:
        print(f"  {name}: {floor * 1e3:.3g} ms from the compiler's HBM bytes and FLOPs, {roofline * 1e3:.3g} ms by the "
              "roofline (both lower bounds on the step's time)")


def _row(candidate, measured: Dict, seconds_per_graph: Optional[float]) -> List[str]:
    run = measured.get("runs", {}).get(candidate.name)
    w = candidate.wastes
    return [candidate.name, str(candidate.plan.model_graphs), str(candidate.graphs),
            *(f"{100 * w[k]:.1f}%" for k in ("prefill", "rows", "context")), f"{100 * candidate.worst_waste:.1f}%",
            f"{candidate.graphs * seconds_per_graph:.0f}" if seconds_per_graph else "-",
            f"{candidate.tpu_tokens_per_s:.0f}" if candidate.tpu_tokens_per_s else "-",
            f"{run.tokens_per_s:.1f}" if run else "-", f"{run.trace_tokens_per_s:.1f}" if run else "-"]


def seconds_per_graph(measured: Dict) -> Optional[float]:
    runs = list(measured.get("runs", {}).values())
    return runs[0].seconds_per_graph if runs else None


def _print_report(report, rows: List[List[str]], measured: Dict, args) -> None:
    result = report.replay
    print(f"replayed {len(report.trace)} requests on the null device in {result.replay_seconds:.1f} s: "
          f"{len(result.steps)} steps, {len(result.calls)} model calls, {result.output_tokens} output tokens")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(COLUMNS)]
    for line in [list(COLUMNS)] + rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(line, widths)))
    plan = report.chosen.plan
    print(f"chosen (optimal, <= {args.max_graphs} model graphs): prefill {list(plan.prefill)}, "
          f"decode rows {list(plan.rows)}, decode context {list(plan.context)}")
    for note in report.lowering_notes:
        print(f"TPU lowering: {note}")
    _print_target(report)
    _print_measured(measured)


def _print_target(report) -> None:
    if report.fit is None:
        return
    fit, gib = report.fit, 1 << 30
    print(f"{report.target.name} (estimated, roofline): per chip {fit.weight_bytes / gib:.2f} GiB weights + "
          f"{fit.kv_bytes / gib:.2f} GiB KV (max_num_seqs x max_model_len) + {fit.activation_bytes / gib:.2f} GiB "
          f"activations of {fit.usable_bytes / gib:.1f} GiB usable: {'fits' if fit.fits else 'DOES NOT FIT'}; "
          f"room for {fit.max_kv_blocks} KV blocks")


def _print_measured(measured: Dict) -> None:
    if "note" in measured:
        print(f"this machine: {measured['note']}")
        return
    for name, run in measured["runs"].items():
        print(f"this machine, {name}: {run.graphs_at_warmup} graphs compiled in {run.warmup_s:.1f} s, "
              f"{run.tokens_per_s:.1f} output tok/s serving the first {measured['requests']} requests, "
              f"{run.trace_tokens_per_s:.1f} for the whole trace at measured model step times, "
              f"{run.graphs_after_warmup} compilations after warm-up")
    for check in measured["checks"]:
        print(f"cost model on this CPU: {check.graph}: measured {1e3 * check.measured_s:.1f} ms, "
              f"roofline {1e3 * check.estimated_s:.1f} ms ({check.ratio:.1f}x)")


def _write_outputs(args, config, report, rows: List[List[str]], measured: Dict, compiled: Optional[Dict]) -> None:
    from tpu_executor.tuning.plot import draw

    if args.out:
        plan, chosen = report.chosen.plan, report.chosen
        write_bucket_file(args.out, {
            **{name: list(buckets) for name, buckets in plan.options().items()}, "max_model_len": config.max_model_len,
            "max_num_seqs": config.scheduler.max_num_seqs, "block_size": config.cache.block_size,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens},
            {"trace": args.trace, "requests": len(report.trace), "max_graphs": args.max_graphs,
             "target": args.target, "wastes": chosen.wastes, "graphs": chosen.graphs})
        print(f"wrote {args.out}")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            csv.writer(handle).writerows([COLUMNS, *rows])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(_report_json(report, measured), compiled=compiled), handle, indent=2, default=str)
    if args.plot:
        draw(report, seconds_per_graph(measured), args.plot)
        print(f"wrote {args.plot}")


def _report_json(report, measured: Dict) -> Dict:
    return {"requests": len(report.trace), "replay_seconds": report.replay.replay_seconds,
            "candidates": [{"name": c.name, "buckets": asdict(c.plan), "model_graphs": c.plan.model_graphs,
                            "graphs": c.graphs, "wastes": c.wastes, "tpu_tokens_per_s": c.tpu_tokens_per_s}
                           for c in report.candidates],
            "target": report.target.name if report.target else None,
            "hbm_fit": asdict(report.fit) if report.fit else None, "lowering": report.lowering_notes,
            "measured": {name: asdict(run) for name, run in measured.get("runs", {}).items()},
            "cost_checks": [asdict(c) for c in measured.get("checks", [])]}
