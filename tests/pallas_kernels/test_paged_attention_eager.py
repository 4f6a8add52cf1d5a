"""paged_attention's eager provider (pages in use, fused SDPA; the native path) against THE reference."""

import torch

from pallas_kernels.paged_attention import eager, ops
from pallas_kernels.paged_attention.reference import paged_attention as reference
from tests.pallas_kernels.kernel_cases import NUM_CASES, case_kinds, generated_cases


def test_pages_in_use_matches_the_reference_on_generated_cases():
    cases = generated_cases(ops.SPEC, seed=6)
    for case in cases:
        ops.SPEC.assert_close(case.run(eager.paged_attention), case.run(reference), case.label)
    assert len(cases) == NUM_CASES and len(case_kinds(cases)) == 8  # dtypes x soft-cap x window


def test_the_table_is_cut_to_the_longest_context():
    tables = torch.arange(12).reshape(2, 6)
    assert eager.pages_in_use(torch.tensor([5, 17]), tables, 8).tolist() == [[0, 1, 2], [6, 7, 8]]
    assert eager.pages_in_use(torch.tensor([1, 1]), tables, 8).shape == (2, 1)
