"""``tpu-executor compile``: compile a serving job for the TPU slice it will run on, here, with
the TPU's own compiler (libtpu, ahead of time: no TPU needed), check that it fits the slice's
HBM, and keep its executables for the TPU host.

    tpu-executor compile /ckpt --target v6e-8 --cache-dir ./aot --json report.json
    # copy ./aot to the TPU VM (same libtpu, same options), then:
    tpu-executor serve /ckpt --device jax --cache-dir ./aot     # loads them, compiles nothing

Only the checkpoint's config.json is read (no weights: an 8B or 70B job compiles on a small
machine); a published model's name (``tune --model``'s list) works too. Every graph of the JAX
path's bucket plan is traced as on the slice, with the Pallas kernels the slice's chips select,
and compiled by libtpu; the table gives each graph's compile time, HBM per chip (arguments,
outputs, temp, generated code, its peak), the compiler's FLOPs and bytes, and its Pallas
kernels. The KV cache gets what is left of each chip's HBM (``--memory-utilization`` of it)
after what stays resident (every model's weights, the draft model's too, the drafter's and the
sampler's buffers) and the largest model graph; every graph is then checked as its own peak
beside all that stays resident, and a job that does not fit exits non-zero, naming what would
make it fit.
"""
from __future__ import annotations

import argparse
import json
import time

from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args
from tpu_executor.entrypoints.compile_job import compile_job
from tpu_executor.tools.published_models import MODEL_SHAPES


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("compile", help="compile and size a job for a TPU slice, ahead of time",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("model", help="checkpoint directory (only its config.json is read), or a published "
                                      f"model's name: {', '.join(MODEL_SHAPES)}")
    parser.add_argument("--target", required=True, help="TPU slice: v4|v5e|v5p|v6e-N, e.g. v5e-1, v6e-8, v5e-16")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    parser.add_argument("--model-steps-only", action="store_true",
                        help="compile the prefill and decode graphs alone: the fit, in less time (a large "
                             "vocabulary's sampling graphs take minutes each); the TPU host compiles the rest")
    add_engine_arguments(parser, exclude=("device",), why=(
        "The engine the TPU host will start (it must be given the same options to find the executables). "
        "--tensor-parallel-size defaults to the slice's chips; --dtype auto is bfloat16 on a TPU; "
        "--cache-dir is where the executables go."))
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_report import print_report, report_json
    from tpu_executor.tools.published_models import model_directory

    start = time.perf_counter()
    try:
        target = Target.parse(args.target)
        with model_directory(args.model) as checkpoint:
            report = compile_job(checkpoint, target, engine_options_from_args(args),
                                 model_steps_only=args.model_steps_only)
    except ValueError as err:  # DoesNotFit, a refused graph, --strict-kernels, a bad option
        raise SystemExit(f"tpu-executor compile: {err}") from None
    print_report(report, time.perf_counter() - start)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report_json(report), handle, indent=2)
        print(f"wrote {args.json}")
    if not report.fits:
        raise SystemExit(f"tpu-executor compile: {report.verdict}")
