"""Running a Pallas kernel in TPU interpret mode on an op's generated cases."""
from __future__ import annotations

import functools
import multiprocessing
import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax
from tpu_executor.kernels.spec import OpCase, OpSpec

NUM_CASES = 100
# A case in TPU interpret mode compiles for its own shapes (2-3 s): the Pallas kernels run fewer,
# still every kind (both dtypes, soft-cap and window on and off).
INTERPRETED_CASES = 16


def in_fresh_process(fn: Callable, *args):
    """``fn(*args)`` in a spawned interpreter that never loads torch_xla; exceptions (and
    assertion messages) come back to the caller.

    Why: jaxlib and torch_xla each bundle their own XLA and LLVM. After torch_xla had compiled
    graphs in the pytest process, a run of a hundred more JAX compilations segfaulted inside
    jaxlib's backend_compile_and_load. The binding test keeps the two in one process on
    purpose (that is the product path); the bulk kernel checks do not need to.
    """
    with _spawned_pool(1) as pool:
        return pool.submit(fn, *args).result()


def _spawned_pool(num_processes: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=num_processes, mp_context=multiprocessing.get_context("spawn"))


def in_fresh_processes(fn: Callable, num_items: int) -> list:
    """``fn(indices)`` for interleaved parts of ``range(num_items)``, each part in a spawned
    interpreter of its own (see ``in_fresh_process``), all at once; the results in part order.

    Why: a case in TPU interpret mode spends 2-3 s compiling for its own shapes, mostly on one
    core, and the generated cases of a kernel are independent; on two cores they finish in
    about two thirds of the time. Interleaving keeps each part's mix of variants and dtypes.
    """
    num_processes = max(1, min(2, os.cpu_count() or 1, num_items))
    parts = [range(start, num_items, num_processes) for start in range(num_processes)]
    with _spawned_pool(num_processes) as pool:
        futures = [pool.submit(fn, part) for part in parts]
        return [future.result() for future in futures]


def value_error_of(call: Callable[[], object]) -> str:
    """The message of the ValueError ``call()`` raises, or "no error"."""
    try:
        call()
    except ValueError as err:
        return str(err)
    return "no error"


def run_jax(kernel: Callable, case: OpCase, interpret_mode: bool = True) -> torch.Tensor:
    """Call a JAX kernel on a torch case (tensors converted both ways), in TPU interpret mode."""
    from jax.experimental.pallas import tpu as pltpu

    args = [torch_to_jax(a) if isinstance(a, torch.Tensor) else a for a in case.args]
    if not interpret_mode:
        return jax_to_torch(kernel(*args, **case.kwargs))
    with pltpu.force_tpu_interpret_mode():
        return jax_to_torch(kernel(*args, **case.kwargs))


def generated_cases(spec: OpSpec, seed: int, count: int = NUM_CASES):
    rng = np.random.default_rng(seed)
    return [spec.generate(rng) for _ in range(count)]


def check_kernel_against_reference(spec: OpSpec, kernel: Callable, cases, variants: Sequence[dict] = ({},),
                                   indices: Optional[Sequence[int]] = None) -> Counter:
    """Every case (or those at ``indices``) within the spec's tolerance; case i runs with
    keyword ``variants[i % n]`` (tile sizes and the like). Returns how many cases of each
    dtype ran."""
    seen = _no_cases()
    for index in range(len(cases)) if indices is None else indices:
        case = cases[index]
        run = functools.partial(kernel, **variants[index % len(variants)])
        expected = case.run(spec.reference)
        spec.assert_close(run_jax(run, case), expected, case.label)
        seen[str(expected.dtype).removeprefix("torch.")] += 1
    return seen


def _no_cases() -> Counter:
    """Per-dtype counts with every dtype at 0 (so a dtype that never ran still shows)."""
    return Counter(float32=0, bfloat16=0)


def total_counts(parts: Sequence[Counter]) -> Counter:
    """The per-dtype counts of all parts added up (a dtype no part ran stays at 0)."""
    total = _no_cases()
    for part in parts:
        total.update(part)
    return total


def check_kernels_agree(spec: OpSpec, ours: Callable, theirs: Callable, cases) -> int:
    """``theirs`` within the spec's tolerance of ``ours`` on every case; returns the count."""
    for case in cases:
        spec.assert_close(run_jax(theirs, case), run_jax(ours, case), case.label)
    return len(cases)


def case_kinds(cases) -> set:
    """(dtype, soft-cap off, window off) of each attention case."""
    return {(str(c.args[0].dtype), c.kwargs["soft_cap"] is None, c.kwargs["sliding_window"] is None)
            for c in cases}


def engine_like_decode_batch(kv_heads: int, heads: int, width: int) -> tuple:
    """Paged-attention arguments shaped like the engine's decode batch: 32 rows with contexts
    of 1-320 tokens over random 16-token pages, head size 64."""
    from tpu_executor.kernels.paged_attention.ops import random_block_tables

    rng = np.random.default_rng(3)
    lens = rng.integers(1, 321, size=32)
    tables, num_blocks = random_block_tables(rng, lens, 16, width)
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randn(kv_heads, num_blocks, 16, 64, generator=gen) for _ in range(2)]
    return (torch.randn(32, heads, 64, generator=gen), *pages, torch.from_numpy(lens.astype(np.int32)), tables)
