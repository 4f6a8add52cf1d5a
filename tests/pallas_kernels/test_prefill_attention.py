"""prefill_attention: our Pallas kernel (TPU interpret mode) against THE reference, block
skipping, and constraint errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels.kernel_cases import (
    INTERPRETED_CASES,
    case_kinds,
    check_kernel_against_reference,
    generated_cases,
    in_fresh_process,
    in_fresh_processes,
    total_counts,
)
from tpu_executor.kernels.binding import on_xla_if_fits
from tpu_executor.kernels.prefill_attention import kernel, ops

pytestmark = pytest.mark.slow  # TPU interpret mode

CASES = generated_cases(ops.SPEC, seed=4, count=INTERPRETED_CASES)
BLOCKS = ((None, None), (16, 128), (32, 128))  # default, and small blocks that skip a lot


def check_generated_cases(indices):
    variants = [{"block_q": block_q, "block_k": block_k} for block_q, block_k in BLOCKS]
    return check_kernel_against_reference(ops.SPEC, kernel.prefill_attention, CASES, variants, indices)


def test_kernel_matches_reference_on_generated_cases():
    assert sum(total_counts(in_fresh_processes(check_generated_cases, len(CASES))).values()) == INTERPRETED_CASES
    kinds = case_kinds(CASES)
    labels = " ".join(case.label for case in CASES)
    assert len(CASES) == INTERPRETED_CASES and len(kinds) == 8
    assert "cached=[16" in labels or "cached=[32" in labels  # prefix-cached context ran


def check_long_context_chunks(indices):
    """Later chunks of long prompts: up to 2,800 keys for up to ~360 queries."""
    rng = np.random.default_rng(5)
    cases = [ops.generate_case(rng, long_context=True) for _ in range(6)]
    check_kernel_against_reference(ops.SPEC, kernel.prefill_attention, cases, indices=indices)
    return [(cases[i].args[0].shape[0], cases[i].args[3].shape[0]) for i in indices]


def test_kernel_matches_reference_on_chunks_with_long_contexts():
    shapes = [shape for part in in_fresh_processes(check_long_context_chunks, 6) for shape in part]
    assert len(shapes) == 6 and all(keys > 1000 and keys > 3 * queries for queries, keys in shapes)


@pytest.mark.parametrize("tokens,keys", [(512, 32768), (2048, 8192)])
def test_kernel_lowers_for_the_tpu_at_long_contexts(tokens, keys):
    """VMEM holds a (query block, key block) tile whatever the context: the kernel streams
    key blocks; the lowering checks Mosaic's shape rules at these widths."""
    from tpu_executor.core.buckets import PrefillGraph
    from tpu_executor.tuning.lowering import lower_graphs
    from tpu_executor.tuning.roofline import ModelShape

    shape = ModelShape(layers=2, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=1000)
    kernel.validate((tokens, 32, 128), (8, 64, 16, 128), "bfloat16", *kernel.choose_blocks(tokens, keys, "bfloat16"))
    assert [r.error for r in in_fresh_process(lower_graphs, [PrefillGraph(tokens, keys)], shape, 1, 16)] == [None]


def needed_blocks_of_two_prompts():
    """One 256-token prompt then a 128-token one, blocks of 64."""
    pos = jnp.concatenate([jnp.arange(256), jnp.arange(128)]).astype(jnp.int32)
    seg = jnp.concatenate([jnp.zeros(256), jnp.ones(128)]).astype(jnp.int32)
    plain = kernel.blocks_needed(pos, seg, pos, seg, 64, 64, None).reshape(6, 6)
    windowed = kernel.blocks_needed(pos, seg, pos, seg, 64, 64, 64).reshape(6, 6)
    return [[int(x) for x in row] for row in plain], [[int(x) for x in row] for row in windowed]


def test_blocks_needed_skips_future_other_prompts_and_stale_window():
    """The causal upper triangle, the other prompt's blocks and (with a window) old blocks
    are skipped, nothing else."""
    plain, windowed = in_fresh_process(needed_blocks_of_two_prompts)
    lower = [[int(j <= i) for j in range(6)] for i in range(6)]
    expected = [[lower[i][j] if (i < 4) == (j < 4) else 0 for j in range(6)] for i in range(6)]
    assert plain == expected
    assert windowed[3][1] == 0 and windowed[3][2] == 1 and windowed[3][3] == 1


@pytest.mark.parametrize("q_shape, pages_shape, dtype, blocks, message", [
    ((64, 4, 64), (2, 10, 16, 64), "float32", (64, 128), "multiple of 128"),
    ((64, 4, 128), (2, 10, 16, 128), "bfloat16", (24, 128), "block_q=24"),
    ((64, 4, 128), (2, 10, 16, 128), "float32", (64, 100), "block_k=100"),
    ((64, 3, 128), (2, 10, 16, 128), "float32", (64, 128), "multiple of kv_heads"),
    ((64, 32, 256), (1, 10, 16, 256), "float32", (512, 2048), "VMEM"),
])
def test_validate_names_the_constraint(q_shape, pages_shape, dtype, blocks, message):
    with pytest.raises(ValueError, match=message):
        kernel.validate(q_shape, pages_shape, dtype, *blocks)


def test_supports_args_declines_what_the_kernel_cannot_run():
    case = CASES[0]
    q, k, v, *rest = case.args
    assert ops.shape_problem(q, k, v, *rest) is None
    small = [t[..., :64].contiguous() for t in (q, k, v)]
    assert "head_dim=64" in ops.shape_problem(*small, *rest)
    assert "dtypes differ" in ops.shape_problem(q.half(), k, v, *rest)
    assert not on_xla_if_fits(ops.shape_problem)(q, k, v, *rest)  # CPU tensors: reference only
