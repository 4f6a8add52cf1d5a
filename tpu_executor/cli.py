"""The ``tpu-executor`` command (installed by setup.py): one subcommand per use.

    tpu-executor generate [MODEL] [--prompt ...] [engine options]
    tpu-executor serve [MODEL] [--host ...] [--port ...] [engine options]
    tpu-executor compile MODEL --target v6e-8 [--cache-dir DIR] [--json FILE] [engine options]
    tpu-executor tune --trace TRACE [--model MODEL] [--max-graphs N] [--target v5e-8] [--out FILE]
    tpu-executor bench throughput | serve | host | chunked-prefill | speculative | sampler | structured | ... [...]

Every subcommand that starts an engine takes the same engine options (``engine/options.py``);
``--help`` shows the defaults that subcommand uses. This module is the composition root: it
may import every feature package, and none imports it.
"""
from __future__ import annotations

import argparse
import logging
from typing import List, Optional

import tpu_executor.bench as bench
from tpu_executor.entrypoints import compile as compile_command
from tpu_executor.entrypoints import generate, serve
from tpu_executor.tuning import command as tune


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu-executor", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (generate, serve, compile_command, tune, bench):
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValueError as err:  # a bad option, checkpoint or file: its message says what to change
        logging.getLogger(__name__).debug("the command failed", exc_info=True)
        parser.exit(2, f"tpu-executor {args.command}: error: {err}\n")


if __name__ == "__main__":
    main()
