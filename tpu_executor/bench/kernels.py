"""``tpu-executor bench kernels``: our Pallas kernels, JAX's shipped kernels and the torch references.

On a TPU (``jax.default_backend() == "tpu"``) the kernels run compiled by Mosaic. Anywhere
else they run in TPU interpret mode, which simulates the TPU (DMAs, semaphores, VMEM) on
the CPU: those timings measure the simulator, say nothing of TPU speed, and are printed
only so the script is useful (and checked) without a TPU. The torch reference always runs
eagerly on the host CPU. Also prints the registry's dispatch cost per call.

    tpu-executor bench kernels [--repeats 5]
"""
from __future__ import annotations

import argparse
import platform
import time
from typing import Callable, Dict

import numpy as np
import torch

from tpu_executor.engine.options import HelpFormatter
from tpu_executor.kernels.binding import torch_to_jax
from tpu_executor.kernels.spec import OpCase


def paged_case(dtype, batch=8, context=512, kv_heads=2, group=4, head_dim=128, block=16) -> OpCase:
    from tpu_executor.kernels.paged_attention.ops import random_block_tables

    rng = np.random.default_rng(0)
    lens = np.full(batch, context)
    tables, num_blocks = random_block_tables(rng, lens, block, context // block)
    pages = [torch.randn(kv_heads, num_blocks, block, head_dim).to(dtype) for _ in range(2)]
    q = torch.randn(batch, kv_heads * group, head_dim).to(dtype)
    return OpCase((q, *pages, torch.from_numpy(lens.astype(np.int32)), tables),
                  {"scale": head_dim ** -0.5}, f"b={batch} ctx={context} kv={kv_heads}x{group} d={head_dim}")


def prefill_case(dtype, prompts=2, length=256, kv_heads=2, group=4, head_dim=128, block=16) -> OpCase:
    tokens = prompts * length
    pages = [torch.randn(kv_heads, tokens // block + 1, block, head_dim).to(dtype) for _ in range(2)]
    positions = torch.arange(length).repeat(prompts)
    segments = torch.arange(prompts).repeat_interleave(length)
    slots = torch.arange(tokens)
    q = torch.randn(tokens, kv_heads * group, head_dim).to(dtype)
    return OpCase((q, *pages, slots, positions, segments, positions, segments),
                  {"scale": head_dim ** -0.5}, f"{prompts}x{length} tokens kv={kv_heads}x{group} d={head_dim}")


def gmm_case(dtype, m=512, k=512, n=1024, groups=8) -> OpCase:
    sizes = torch.full((groups,), m // groups, dtype=torch.int32)
    lhs, rhs = torch.randn(m, k).to(dtype), (torch.randn(groups, k, n) / k ** 0.5).to(dtype)
    return OpCase((lhs, rhs, sizes), {}, f"m={m} k={k} n={n} groups={groups}")


def seconds_per_call(fn: Callable, repeats: int) -> float:
    fn()  # compile / warm up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def jax_timer(kernel: Callable, case: OpCase, on_tpu: bool) -> Callable:
    from jax.experimental.pallas import tpu as pltpu

    args = [torch_to_jax(a) for a in case.args]

    def call():
        if on_tpu:
            return kernel(*args, **case.kwargs).block_until_ready()
        with pltpu.force_tpu_interpret_mode():
            return kernel(*args, **case.kwargs).block_until_ready()
    return call


def providers() -> Dict[str, tuple]:
    """op -> (spec, case builder, {provider name: JAX function})."""
    from tpu_executor.kernels.gmm import kernel as gmm_kernel
    from tpu_executor.kernels.gmm import ops as gmm_ops
    from tpu_executor.kernels.paged_attention import kernel as paged_kernel
    from tpu_executor.kernels.paged_attention import ops as paged_ops
    from tpu_executor.kernels.prefill_attention import kernel as prefill_kernel
    from tpu_executor.kernels.prefill_attention import ops as prefill_ops

    return {
        "paged_attention": (paged_ops.SPEC, paged_case, {
            "pallas (ours)": paged_kernel.paged_attention,
            "jax shipped": paged_ops._jax_paged_attention}),
        "prefill_attention": (prefill_ops.SPEC, prefill_case, {
            "pallas (ours)": prefill_kernel.prefill_attention}),
        "gmm": (gmm_ops.SPEC, gmm_case, {
            "pallas (ours)": gmm_kernel.gmm, "jax megablox": gmm_ops._megablox_gmm}),
    }


def dispatch_microseconds(repeats: int = 2000) -> float:
    """Registry dispatch overhead (selecting the provider) per call."""
    from tpu_executor.kernels import REGISTRY, register_all
    from tpu_executor.kernels.gmm.ops import OP_NAME

    register_all()
    case = gmm_case(torch.float32, m=8, k=128, n=128)
    start = time.perf_counter()
    for _ in range(repeats):
        REGISTRY.select(OP_NAME, *case.args, **case.kwargs)
    return (time.perf_counter() - start) / repeats * 1e6


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("kernels", help="the Pallas kernels, JAX's shipped kernels and the torch references",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per kernel after a warm-up call")
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> None:
    import jax

    on_tpu = jax.default_backend() == "tpu"
    where = "TPU (Mosaic)" if on_tpu else f"TPU interpret mode on {platform.processor() or 'CPU'}"
    print(f"kernels: {where}; reference: eager torch on the host CPU; repeats={args.repeats}")
    print("| op | shape | dtype | provider | ms/call |\n|---|---|---|---|---|")
    for op, (spec, build, kernels) in providers().items():
        for dtype in (torch.float32, torch.bfloat16):
            case = build(dtype)
            rows = {name: seconds_per_call(jax_timer(fn, case, on_tpu), args.repeats)
                    for name, fn in kernels.items()}
            rows["torch reference (CPU)"] = seconds_per_call(lambda: case.run(spec.reference), args.repeats)
            for name, seconds in rows.items():
                print(f"| {op} | {case.label} | {str(dtype)[6:]} | {name} | {seconds * 1e3:.2f} |")
    print(f"registry dispatch: {dispatch_microseconds():.1f} us per call (trace time only under torch.compile)")
