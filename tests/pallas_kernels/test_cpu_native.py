"""The native path's C kernel for paged decode attention (``cpu_c``) against THE reference."""

import pytest
import torch

from tpu_executor.kernels import OpRegistry, register_all
from tpu_executor.kernels.paged_attention import cpu_native
from tpu_executor.kernels.paged_attention.ops import SPEC
from tests.pallas_kernels.kernel_cases import case_kinds, engine_like_decode_batch, generated_cases

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="no C compiler to build the kernel")


def test_matches_the_reference_on_the_generated_fp32_cases():
    cases = [c for c in generated_cases(SPEC, seed=11) if c.args[0].dtype == torch.float32]
    for case in cases:
        assert cpu_native.supports_args(*case.args, **case.kwargs), case.label
        SPEC.assert_close(case.run(cpu_native.paged_attention), case.run(SPEC.reference), case.label)
    assert len(case_kinds(cases)) == 4  # soft-cap x window, all fp32


@pytest.mark.parametrize("window", [None, 40])
def test_a_decode_batch_of_smollm2_heads_matches_the_reference(window):
    """32 rows of 1-320 tokens, 9 heads over 3 KV heads of 64 (SmolLM2), on torch's threads."""
    args = engine_like_decode_batch(kv_heads=3, heads=9, width=22)
    kwargs = dict(scale=0.125, sliding_window=window)
    SPEC.assert_close(cpu_native.paged_attention(*args, **kwargs), SPEC.reference(*args, **kwargs), "32 rows")


def test_a_table_that_does_not_cover_the_context_raises_before_reading():
    pages = [torch.zeros(1, 4, 8, 16) for _ in range(2)]
    q = torch.zeros(2, 2, 16)
    with pytest.raises(ValueError, match="row 1's context of 17 tokens"):
        cpu_native.paged_attention(q, *pages, torch.tensor([3, 17]), torch.tensor([[0, 1], [2, 3]]), scale=1.0)
    with pytest.raises(ValueError, match="row 0's context"):
        cpu_native.paged_attention(q, *pages, torch.tensor([9, 1]), torch.tensor([[0, 4], [2, 3]]), scale=1.0)


def test_serves_fp32_cpu_calls_only():
    registry = register_all(OpRegistry())
    q, pages = torch.zeros(2, 4, 16), torch.zeros(2, 3, 8, 16)
    args = (q, pages, pages, torch.tensor([1, 2]), torch.zeros(2, 1, dtype=torch.long))
    assert registry.select("paged_attention", *args, scale=1.0).name == "cpu_c"
    bf16 = (q.bfloat16(), pages.bfloat16(), pages.bfloat16(), *args[3:])
    assert registry.select("paged_attention", *bf16, scale=1.0).name == "eager_sdpa"
