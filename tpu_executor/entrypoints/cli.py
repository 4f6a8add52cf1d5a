"""The ``tpu-executor`` command (installed by setup.py): one subcommand per use.

    tpu-executor generate [MODEL] [--prompt ...] [engine options]
    tpu-executor serve [MODEL] [--host ...] [--port ...] [engine options]
    tpu-executor bench throughput [--models ...] [engine options]
    tpu-executor bench serve [--base-url URL | --launch MODEL] [--request-rate ...]
    tpu-executor bench host | chunked-prefill [...]
    tpu-executor tune --trace TRACE [--model MODEL] [--max-graphs N] [--target v5e-8] [--out FILE]

Every subcommand that starts an engine takes the same engine options (``engine/options.py``).
"""
from __future__ import annotations

import argparse
import logging
from typing import List, Optional

from tpu_executor.entrypoints import bench, bench_chunked, bench_host, bench_serve, generate, serve, tune


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """``bench`` and its subcommands, one module each: ``throughput`` (bench.py), ``serve``,
    ``host``, ``chunked-prefill``."""
    parser = subparsers.add_parser("bench", help="benchmarks: offline throughput, or a server under load")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module in (bench, bench_serve, bench_host, bench_chunked):
        module.add_parser(benchmarks)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu-executor", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, serve, tune):
        module.add_parser(subparsers)
    add_bench_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
