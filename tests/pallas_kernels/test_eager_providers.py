"""The native path's eager attention providers against THE reference: prefill one packed
segment at a time (``eager_segments``), decode over the pages in use (``eager_sdpa``)."""

import importlib

import pytest
import torch

from tests.pallas_kernels.kernel_cases import NUM_CASES, case_kinds, engine_like_decode_batch, generated_cases
from tpu_executor.kernels.paged_attention import eager as paged_eager
from tpu_executor.kernels.prefill_attention import eager as prefill_eager


@pytest.mark.parametrize("op", ["paged_attention", "prefill_attention"])
def test_eager_provider_matches_the_reference_on_generated_cases(op):
    spec = importlib.import_module(f"tpu_executor.kernels.{op}.ops").SPEC
    provider = importlib.import_module(f"tpu_executor.kernels.{op}.eager")
    cases = generated_cases(spec, seed=5)
    for case in cases:
        spec.assert_close(case.run(getattr(provider, op)), case.run(spec.reference), case.label)
    assert len(cases) == NUM_CASES and len(case_kinds(cases)) == 8  # dtypes x soft-cap x window


def test_segment_runs_and_split_segments():
    assert prefill_eager.segment_runs(torch.tensor([0, 0, 1, 1, 1, -1])) == [(0, 0, 2), (1, 2, 5), (-1, 5, 6)]
    assert prefill_eager.one_run_each(prefill_eager.segment_runs(torch.tensor([0, 1, 0]))) == {}


def test_a_split_segment_falls_back_to_the_whole_reference():
    """Queries of one prompt on both sides of another's: not the runner's packing, still exact."""
    from tpu_executor.kernels.prefill_attention.reference import prefill_attention as reference

    gen = torch.Generator().manual_seed(0)
    pages = [torch.randn(2, 4, 8, 16, generator=gen) for _ in range(2)]
    q = torch.randn(6, 4, 16, generator=gen)
    segments = torch.tensor([0, 0, 1, 1, 0, 0])
    positions = torch.tensor([0, 1, 0, 1, 2, 3])
    slots = torch.tensor([0, 1, 8, 9, 2, 3])
    args = (q, *pages, slots, positions, segments, positions, segments)
    torch.testing.assert_close(prefill_eager.prefill_attention(*args, scale=0.25), reference(*args, scale=0.25))


def test_the_decode_table_is_cut_to_the_longest_context():
    tables = torch.arange(12).reshape(2, 6)
    assert paged_eager.pages_in_use(torch.tensor([5, 17]), tables, 8).tolist() == [[0, 1, 2], [6, 7, 8]]
    assert paged_eager.pages_in_use(torch.tensor([1, 1]), tables, 8).shape == (2, 1)


def test_rows_of_spread_contexts_split_in_two_groups_by_length():
    lens = torch.tensor([300, 20, 290, 17, 33, 310])
    short, long = paged_eager.length_groups(lens, 16)
    assert sorted(short.tolist()) == [1, 3, 4] and sorted(long.tolist()) == [0, 2, 5]
    assert paged_eager.length_groups(torch.tensor([100, 97, 110]), 16) is None  # too alike to pay
    assert paged_eager.length_groups(torch.tensor([5]), 16) is None


@pytest.mark.parametrize("window", [None, 40])
def test_grouped_rows_match_the_reference(window):
    """32 decode rows with contexts of 1-320 tokens, as the engine's batch has them."""
    from tpu_executor.kernels.paged_attention.ops import SPEC

    args = engine_like_decode_batch(kv_heads=2, heads=6, width=20)
    assert paged_eager.length_groups(args[3], 16) is not None
    kwargs = dict(scale=0.125, sliding_window=window)
    SPEC.assert_close(paged_eager.paged_attention(*args, **kwargs), SPEC.reference(*args, **kwargs), "32 rows")
