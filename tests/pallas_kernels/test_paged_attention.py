"""paged_attention: our Pallas kernel (TPU interpret mode) against THE reference and against
JAX's shipped kernel; constraint errors and registry fallback."""
import dataclasses
import functools

import pytest
import torch

from tests.pallas_kernels.kernel_cases import (
    INTERPRETED_CASES,
    case_kinds,
    check_kernel_against_reference,
    check_kernels_agree,
    generated_cases,
    in_fresh_process,
    in_fresh_processes,
    run_jax,
    total_counts,
    value_error_of,
)
from tpu_executor.kernels.paged_attention import kernel, ops

pytestmark = pytest.mark.slow  # TPU interpret mode

CASES = generated_cases(ops.SPEC, seed=18, count=INTERPRETED_CASES)


def check_generated_cases(indices):
    """Pages per grid step cycle through 1, 2 and the default, so the online softmax runs
    over one chunk and over many."""
    return check_kernel_against_reference(ops.SPEC, kernel.paged_attention, CASES,
                                          variants=({"pages_per_chunk": 1}, {"pages_per_chunk": 2}, {}),
                                          indices=indices)


def queries(case) -> int:
    """Query rows per sequence (1: a decode; more: a verify)."""
    q, _, _, _, tables = case.args
    return q.shape[0] // tables.shape[0]


def test_kernel_matches_reference_on_generated_cases():
    assert sum(total_counts(in_fresh_processes(check_generated_cases, len(CASES))).values()) == INTERPRETED_CASES
    kinds = case_kinds(CASES)
    assert len(CASES) == INTERPRETED_CASES and len(kinds) == 8  # both dtypes x cap on/off x window on/off
    # Verifies (several queries a sequence), with a sliding window too.
    assert sum(queries(c) > 1 for c in CASES) >= 8
    assert sum(queries(c) > 1 and c.kwargs["sliding_window"] is not None for c in CASES) >= 4


def bf16_representable(case):
    """JAX's kernel reads K/V as bf16: give both kernels K/V that survive that rounding."""
    q, k, v, lens, tables = case.args
    k, v = (t.to(torch.bfloat16).to(t.dtype) for t in (k, v))
    return dataclasses.replace(case, args=(q, k, v, lens, tables))


def compare_with_jax_shipped_kernel(indices):
    cases = [bf16_representable(CASES[i]) for i in indices
             if CASES[i].kwargs["sliding_window"] is None and queries(CASES[i]) == 1]
    return check_kernels_agree(ops.SPEC, kernel.paged_attention, ops._jax_paged_attention, cases)


def test_kernel_agrees_with_jax_shipped_kernel():
    assert sum(in_fresh_processes(compare_with_jax_shipped_kernel, 16)) >= 5


@pytest.mark.parametrize("q_shape, pages_shape, dtype, message", [
    ((2, 4, 64), (2, 10, 16, 64), "float32", "multiple of 128"),
    ((2, 4, 128), (2, 10, 8, 128), "bfloat16", "block_size=8"),
    ((2, 3, 128), (2, 10, 16, 128), "float32", "multiple of kv_heads"),
    ((2, 4, 128), (2, 10, 16, 128), "float16", "supports"),
])
def test_validate_names_the_constraint(q_shape, pages_shape, dtype, message):
    with pytest.raises(ValueError, match=message):
        kernel.validate(q_shape, pages_shape, dtype, 1)


def test_vmem_budget_is_enforced():
    with pytest.raises(ValueError, match="VMEM"):
        kernel.validate((1, 8, 256), (8, 4096, 256, 256), "float32", 64)


def call_with_small_head_dim():
    import jax.numpy as jnp

    q = jnp.zeros((1, 2, 64), jnp.float32)
    pages = jnp.zeros((1, 4, 16, 64), jnp.float32)
    return value_error_of(lambda: kernel.paged_attention(q, pages, pages, jnp.ones(1, jnp.int32),
                                                         jnp.zeros((1, 1), jnp.int32), scale=1.0, interpret=True))


def test_direct_call_raises_a_clear_error():
    assert "head_dim=64 must be a multiple of 128" in in_fresh_process(call_with_small_head_dim)


def run_in_sub_batches():
    """With an SMEM budget of two table rows, the batch runs as several kernel calls."""
    case = next(c for c in CASES if c.args[0].shape[0] >= 4 and c.args[0].dtype == torch.float32)
    kernel.SMEM_TABLE_BUDGET_BYTES = 2 * case.args[4].shape[1] * 4
    calls = []
    real_call = kernel._call
    kernel._call = lambda q, *a, **kw: calls.append(q.shape[0]) or real_call(q, *a, **kw)
    run = functools.partial(kernel.paged_attention, pages_per_chunk=1)
    ops.SPEC.assert_close(run_jax(run, case), case.run(ops.SPEC.reference), case.label)
    return calls, case.args[0].shape[0]


def test_large_block_tables_are_cut_into_sub_batches():
    calls, batch = in_fresh_process(run_in_sub_batches)  # patches the child's kernel module only
    assert len(calls) > 1 and max(calls) <= 2 and sum(calls) == batch


def test_shipped_provider_declines_sliding_window_and_fp32():
    case = next(c for c in CASES if c.kwargs["sliding_window"] is not None and
                ops.shape_problem(*c.args) is None)
    assert ops.shape_problem(*case.args, **case.kwargs) is None
    assert "sliding window" in ops.shipped_kernel_problem(*case.args, **case.kwargs)
    fp32 = next(c for c in CASES if c.args[0].dtype == torch.float32 and c.kwargs["sliding_window"] is None)
    assert "bf16" in ops.shipped_kernel_problem(*fp32.args, **fp32.kwargs)
    bf16 = next(c for c in CASES if c.args[0].dtype == torch.bfloat16 and c.kwargs["sliding_window"] is None)
    assert ops.shipped_kernel_problem(*bf16.args, **bf16.kwargs) is None


def test_int64_metadata_reaches_kernels_as_int32():
    """The engine builds lengths and tables as int64; TPU providers cast them to int32."""
    from tpu_executor.kernels.binding import with_int32_indices

    seen = []
    call = with_int32_indices(lambda: lambda *args, **kw: seen.extend(a.dtype for a in args))
    call(torch.zeros(2), torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    assert seen == [torch.float32, torch.int32, torch.int32]
