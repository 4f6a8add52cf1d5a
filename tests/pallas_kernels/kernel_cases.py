"""Running a Pallas kernel in TPU interpret mode on an op's generated cases."""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import numpy as np
import torch

from pallas_kernels.binding import jax_to_torch, torch_to_jax
from pallas_kernels.spec import OpCase, OpSpec

NUM_CASES = 100


def in_fresh_process(fn: Callable, *args):
    """``fn(*args)`` in a spawned interpreter that never loads torch_xla; exceptions (and
    assertion messages) come back to the caller.

    Why: jaxlib and torch_xla each bundle their own XLA and LLVM. After torch_xla had compiled
    graphs in the pytest process, a run of a hundred more JAX compilations segfaulted inside
    jaxlib's backend_compile_and_load. The binding test keeps the two in one process on
    purpose (that is the product path); the bulk kernel checks do not need to.
    """
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


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


def check_kernel_against_reference(spec: OpSpec, kernel: Callable, cases) -> dict:
    """Every case within the spec's tolerance; returns how many of each kind ran."""
    seen = {"float32": 0, "bfloat16": 0}
    for case in cases:
        expected = case.run(spec.reference)
        spec.assert_close(run_jax(kernel, case), expected, case.label)
        seen[str(expected.dtype).removeprefix("torch.")] += 1
    return seen
