"""``tpu-executor bench cpu-matmul``: the native CPU path's matmul forms side by side.

For SmolLM2's and gemma-100m's layer shapes: ``packed_matmul``'s C kernel on weights packed
into panels (the native path's form where it builds), oneDNN's packed matmul (the form where
it does not, and vLLM-CPU's) and torch's ``x @ W`` (MKL), each at the given row counts. Cold:
each call takes the next of enough copies of the weight to fill the L3 cache several times
over, as a model's layers do in a step; hot: one weight called again and again. Microseconds
per call, and the C kernel's speed-up over oneDNN.

    tpu-executor bench cpu-matmul [--rows 8 32 512] [--cold-bytes 256] [--repeats 5]
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.engine.options import HelpFormatter

# (in, out) features of the layers: SmolLM2's QKV, output, gate/up and down projections, then
# gemma-100m's gate/up and down.
SHAPES: Tuple[Tuple[int, int], ...] = ((576, 960), (576, 576), (576, 3072), (1536, 576), (768, 6144), (3072, 768))


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("cpu-matmul", help="the native CPU path's matmul forms: C panels, oneDNN, x @ W",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32, 512], help="rows of x per call")
    parser.add_argument("--cold-bytes", type=int, default=256,
                        help="MiB of weight copies the cold calls cycle through (several times the L3 cache)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the copies (cold), x20 calls (hot)")
    parser.set_defaults(run=run)
    return parser


def forms() -> Dict[str, Tuple[Callable, Callable]]:
    """Form name -> (pack a weight [in, out], multiply x by a packed weight of so many output
    features), for the forms this machine has."""
    from tpu_executor.kernels.packed_matmul import cpu_native
    from tpu_executor.kernels.packed_matmul.reference import pack
    from tpu_executor.models.layers.cpu_matmul import onednn_matmul, onednn_packed

    available = {}
    if cpu_native.supported():
        available["C panels"] = (pack, lambda x, w, width: cpu_native.packed_matmul(x, w, out_features=width))
    if torch.backends.mkldnn.is_available():
        available["oneDNN"] = (onednn_packed, lambda x, w, width: onednn_matmul(x, w))
    available["x @ W (MKL)"] = (lambda weight: weight.contiguous(), lambda x, w, width: x @ w)
    return available


def microseconds(multiply: Callable, x: torch.Tensor, weights: Sequence[torch.Tensor], width: int,
                 calls: int) -> float:
    """Mean microseconds per call, cycling through ``weights`` (after one warm-up pass)."""
    for weight in weights:
        multiply(x, weight, width)
    start = time.perf_counter()
    for call in range(calls):
        multiply(x, weights[call % len(weights)], width)
    return (time.perf_counter() - start) / calls * 1e6


def packed_copies(pack: Callable, in_features: int, out_features: int, count: int) -> List[torch.Tensor]:
    """``count`` packed copies of one random weight (each its own memory)."""
    weight = torch.randn(in_features, out_features, generator=torch.Generator().manual_seed(0))
    return [pack(weight.clone()) for _ in range(count)]


def shape_rows(in_features: int, out_features: int, available: Dict[str, Tuple[Callable, Callable]],
               args: argparse.Namespace) -> List[str]:
    """The table's rows for one layer shape, one per row count, timing the ``available`` forms."""
    count = max(2, math.ceil(args.cold_bytes * 2**20 / (in_features * out_features * 4)))
    timings = {}
    for name, (pack, multiply) in available.items():
        copies = packed_copies(pack, in_features, out_features, count)
        for rows in args.rows:
            x = torch.randn(rows, in_features)
            timings[name, rows] = (microseconds(multiply, x, copies, out_features, count * args.repeats),
                                   microseconds(multiply, x, copies[:1], out_features, 20 * args.repeats))
        del copies
    lines = []
    for rows in args.rows:
        cells = [f"{timings[name, rows][0]:,.0f} / {timings[name, rows][1]:,.0f}" for name in available]
        ratio = "-"
        if ("C panels", rows) in timings and ("oneDNN", rows) in timings:
            ratio = f"{timings['oneDNN', rows][0] / timings['C panels', rows][0]:.2f}x"
        lines.append(f"| {in_features} -> {out_features} | {rows} | " + " | ".join(cells) + f" | {ratio} |")
    return lines


def run(args: argparse.Namespace) -> None:
    available = forms()
    print(f"{cpu_description()}; {torch.get_num_threads()} threads; us per call, cold / hot")
    print("| features | rows | " + " | ".join(available) + " | C panels vs oneDNN, cold |")
    print("|---|---|" + "---|" * len(available) + "---|")
    for in_features, out_features in SHAPES:
        for line in shape_rows(in_features, out_features, available, args):
            print(line, flush=True)
