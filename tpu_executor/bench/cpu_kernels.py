"""``tpu-executor bench cpu-kernels``: each C kernel of the native path against the form that
serves its op without it, at a model's decode and prefill sizes, on this machine's CPU.

The other form is the op's next provider (``eager_fused`` RMSNorm, ``eager_sdpa`` paged
attention, ``eager_segments`` prefill attention; the torch reference for the rest), the one the
native path runs where the C kernel is not built. Sizes are SmolLM2-135M's (hidden 576, 9 query
and 3 KV heads of 64, MLP 1,536), 32 sequences of 256 tokens in a decode step and 512 prompt
tokens in a prefill, fp32. ``packed_matmul`` has its own command (``bench cpu-matmul``). The
``-mno-avx512f`` and ``-march`` the kernels build with are the machine's (``-march=native``), so
on an AVX2 machine this is the AVX2 build. Microseconds per call and the C kernel's speed-up.

    tpu-executor bench cpu-kernels [--repeats 50]
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Tuple

import torch

from tpu_executor.bench.hardware import cpu_description
from tpu_executor.engine.options import HelpFormatter

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 576, 9, 3, 64, 1536
DECODE_SEQS, CONTEXT, PREFILL_TOKENS, BLOCK = 32, 256, 512, 16
C_PROVIDER = "cpu_c"


def rope_case(tokens: int):
    positions = torch.arange(tokens).float() % CONTEXT
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM)
    return (qkv[:, :HEADS], angles.cos(), angles.sin()), {}


def kv_write_case(tokens: int):
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM)
    blocks = DECODE_SEQS * CONTEXT // BLOCK + 1
    caches = [torch.zeros(KV_HEADS, blocks, BLOCK, HEAD_DIM) for _ in range(2)]
    slots = torch.randperm(blocks * BLOCK)[:tokens]
    return (qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:], *caches, slots), {}


def paged_case(_tokens: int):
    from tpu_executor.bench.kernels import paged_case as case

    built = case(torch.float32, batch=DECODE_SEQS, context=CONTEXT, kv_heads=KV_HEADS,
                 group=HEADS // KV_HEADS, head_dim=HEAD_DIM, block=BLOCK)
    return built.args, built.kwargs


def prefill_case(tokens: int):
    from tpu_executor.bench.kernels import prefill_case as case

    built = case(torch.float32, prompts=2, length=tokens // 2, kv_heads=KV_HEADS, group=HEADS // KV_HEADS,
                 head_dim=HEAD_DIM, block=BLOCK)
    return built.args, built.kwargs


# op -> (step kinds it runs in, case builder: tokens -> (args, kwargs))
CASES: Dict[str, Tuple[Tuple[str, ...], Callable]] = {
    "rms_norm": (("decode", "prefill"), lambda tokens: ((torch.randn(tokens, HIDDEN), torch.randn(HIDDEN)),
                                                        {"eps": 1e-5, "residual": torch.randn(tokens, HIDDEN)})),
    "act_and_mul": (("decode", "prefill"), lambda tokens: ((torch.randn(tokens, 2 * MLP),), {"activation": "silu"})),
    "rotary_embedding": (("decode", "prefill"), rope_case),
    "write_kv_cache": (("decode", "prefill"), kv_write_case),
    "paged_attention": (("decode",), paged_case),
    "prefill_attention": (("prefill",), prefill_case),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("cpu-kernels", help="the native path's C kernels against the forms without them",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--repeats", type=int, default=50, help="timed calls per kernel and size after a warm-up")
    parser.set_defaults(run=run)
    return parser


def microseconds(fn: Callable, args, kwargs, repeats: int) -> float:
    """Mean microseconds per call after a first one (which builds a C library)."""
    from tpu_executor.bench.kernels import seconds_per_call

    return seconds_per_call(lambda: fn(*args, **kwargs), repeats) * 1e6


def contenders(op: str, args, kwargs) -> List:
    """The op's C provider (timed even where its static check stands it aside on this CPU) and
    the provider that serves these arguments without it."""
    from tpu_executor.kernels import REGISTRY

    providers = [p for p in REGISTRY.providers(op) if not p.jax_path]
    c_kernel = [p for p in providers if p.name == C_PROVIDER]
    others = sorted((p for p in providers if p.name != C_PROVIDER and p.supported() and
                     p.supports_args(*args, **kwargs)), key=lambda p: -p.priority)
    return c_kernel[:1] + others[:1]


def op_rows(op: str, repeats: int) -> List[str]:
    from tpu_executor.kernels import cpu_library

    kinds, build = CASES[op]
    rows = []
    for kind in kinds:
        args, kwargs = build(DECODE_SEQS if kind == "decode" else PREFILL_TOKENS)
        c_kernel, other = contenders(op, args, kwargs)
        if not cpu_library.can_build():
            rows.append(f"| {op} | {kind} | not built (no compiler) | {other.name} | - | - | - |")
            continue
        mine, theirs = (microseconds(p.fn, args, kwargs, repeats) for p in (c_kernel, other))
        used = "yes" if c_kernel.supported() and c_kernel.supports_args(*args, **kwargs) else \
            "no: stands aside on this CPU"
        rows.append(f"| {op} | {kind} | {mine:,.1f} | {other.name} | {theirs:,.1f} | {theirs / mine:.2f}x | {used} |")
    return rows


def run(args: argparse.Namespace) -> None:
    from tpu_executor.kernels import register_all

    register_all()
    print(f"{cpu_description()}; {torch.get_num_threads()} threads; fp32, us per call")
    print("| op | step | C kernel | other form | other | C speed-up | C used here |\n|---|---|---|---|---|---|---|")
    for op in CASES:
        for line in op_rows(op, args.repeats):
            print(line, flush=True)
