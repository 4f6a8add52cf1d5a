"""prefill_attention's eager provider (segment by segment, the native path) against THE reference."""

import torch

from pallas_kernels.prefill_attention import eager, ops
from pallas_kernels.prefill_attention.reference import prefill_attention as reference
from tests.pallas_kernels.kernel_cases import NUM_CASES, case_kinds, generated_cases


def test_segments_match_the_reference_on_generated_cases():
    cases = generated_cases(ops.SPEC, seed=5)
    for case in cases:
        ops.SPEC.assert_close(case.run(eager.prefill_attention), case.run(reference), case.label)
    assert len(cases) == NUM_CASES and len(case_kinds(cases)) == 8  # dtypes x soft-cap x window


def test_segment_runs_and_split_segments():
    assert eager.segment_runs(torch.tensor([0, 0, 1, 1, 1, -1])) == [(0, 0, 2), (1, 2, 5), (-1, 5, 6)]
    assert eager.one_run_each(eager.segment_runs(torch.tensor([0, 1, 0]))) == {}


def test_a_split_segment_falls_back_to_the_whole_reference():
    """Queries of one prompt on both sides of another's: not the runner's packing, still exact."""
    gen = torch.Generator().manual_seed(0)
    pages = [torch.randn(2, 4, 8, 16, generator=gen) for _ in range(2)]
    q = torch.randn(6, 4, 16, generator=gen)
    segments = torch.tensor([0, 0, 1, 1, 0, 0])
    positions = torch.tensor([0, 1, 0, 1, 2, 3])
    slots = torch.tensor([0, 1, 8, 9, 2, 3])
    args = (q, *pages, slots, positions, segments, positions, segments)
    torch.testing.assert_close(eager.prefill_attention(*args, scale=0.25), reference(*args, scale=0.25))
