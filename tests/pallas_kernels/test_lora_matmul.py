"""``lora_matmul``: the one-hot form (traced graphs), the grouped form and the C kernel (eager
calls) against THE reference on generated cases; tokens of slot 0 get no update whatever slot
0 holds."""
import pytest
import torch

from tests.pallas_kernels.kernel_cases import NUM_CASES, generated_cases
from tpu_executor.kernels.lora_matmul import cpu_native, forms, ops, reference

needs_compiler = pytest.mark.skipif(not cpu_native.supported(), reason="no C compiler to build the kernel")


def test_both_forms_match_the_reference_on_generated_cases():
    cases = generated_cases(ops.SPEC, seed=2)
    for case in cases:
        expected = case.run(reference.lora_matmul)
        for form in (forms.one_hot, forms.grouped):
            ops.SPEC.assert_close(case.run(form), expected, f"{form.__name__} {case.label}")
    assert len(cases) == NUM_CASES
    assert {c.args[0].dtype for c in cases} == {torch.float32, torch.bfloat16}
    assert any(len(set(c.args[3].tolist())) > 2 for c in cases)  # several adapters in one call
    packed = [c.kwargs["out_slices"] for c in cases if c.kwargs["out_slices"]]
    assert {len(s) for s in packed} == {2, 3}


def test_slot_zero_is_the_base_model():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen)
    lora_a, lora_b = torch.randn(3, 8, 4, generator=gen), torch.randn(3, 4, 5, generator=gen)
    slots = torch.tensor([0, 1, 2, 0, 2, 1])
    for fn in (reference.lora_matmul, forms.one_hot, forms.grouped):
        out = fn(x, lora_a, lora_b, slots)
        assert out[slots == 0].abs().max() == 0
        torch.testing.assert_close(out[1], (x[1] @ lora_a[1]) @ lora_b[1])


@needs_compiler
def test_the_c_kernel_matches_the_reference_on_generated_fp32_cases():
    cases = [c for c in generated_cases(ops.SPEC, seed=3, count=60) if c.args[0].dtype == torch.float32]
    for case in cases:
        assert cpu_native.supports_args(*case.args), case.label
        ops.SPEC.assert_close(case.run(cpu_native.lora_matmul), case.run(reference.lora_matmul), case.label)
    ranks = {c.args[1].shape[2] % 16 for c in cases}
    assert {0, 8} <= ranks and any(c.args[2].shape[2] % 16 for c in cases)  # vector tails taken both ways
    assert any(c.args[0].shape[0] == 64 for c in cases)  # enough work to run on every thread
    assert any(c.kwargs["out_slices"] for c in cases)  # packed projections


@needs_compiler
def test_the_c_kernel_reads_x_with_a_row_stride_and_refuses_a_slot_out_of_range():
    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 24, generator=gen)
    lora_a, lora_b = torch.randn(3, 16, 8, generator=gen), torch.randn(3, 8, 20, generator=gen)
    slots = torch.tensor([2, 0, 1, 1, 2])
    x = wide[:, 4:20]  # a view: rows 24 floats apart
    torch.testing.assert_close(cpu_native.lora_matmul(x, lora_a, lora_b, slots),
                               reference.lora_matmul(x, lora_a, lora_b, slots))
    with pytest.raises(IndexError, match="outside the 3 slots"):
        cpu_native.lora_matmul(x, lora_a, lora_b, torch.tensor([0, 1, 3, 1, 0]))


def test_packed_projections_read_only_their_blocks_of_b():
    """QKV-like packing: each projection's update is its own rank columns through its block of
    B; what B holds outside the blocks is never read, and uncovered features stay zero."""
    gen = torch.Generator().manual_seed(2)
    x, slots = torch.randn(5, 12, generator=gen), torch.tensor([1, 0, 2, 1, 2])
    lora_a, lora_b = torch.randn(3, 12, 6, generator=gen), torch.randn(3, 6, 10, generator=gen)
    out_slices = ((0, 4), (4, 2), (6, 2))  # features 8 and 9 in no projection
    expected = torch.zeros(5, 10)
    for t, slot in enumerate(slots.tolist()):
        for p, (start, length) in enumerate(out_slices):
            if slot:
                columns = slice(2 * p, 2 * p + 2)
                features = slice(start, start + length)
                expected[t, features] = x[t] @ lora_a[slot][:, columns] @ lora_b[slot][columns, features]
    for fn in [reference.lora_matmul, forms.one_hot, forms.grouped] + [cpu_native.lora_matmul] * cpu_native.supported():
        torch.testing.assert_close(fn(x, lora_a, lora_b, slots, out_slices), expected, msg=fn.__module__)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("side", ["a", "b"])
def test_a_non_finite_value_in_one_slot_stays_in_that_slot(bad, side):
    """One inf or NaN in slot 2's A or B (packed projections): every form gives the base
    model's tokens exactly zero and the other slots' tokens exactly what they get from clean
    weights (close to the reference's); only slot 2's own tokens may see it."""
    gen = torch.Generator().manual_seed(3)
    x, slots = torch.randn(7, 12, generator=gen), torch.tensor([0, 1, 2, 3, 2, 0, 1])
    lora_a, lora_b = torch.randn(4, 12, 6, generator=gen), torch.randn(4, 6, 10, generator=gen)
    out_slices = ((0, 4), (4, 6))
    poisoned_a, poisoned_b = lora_a.clone(), lora_b.clone()
    if side == "a":
        poisoned_a[2, 5, 1] = bad
    else:
        poisoned_b[2, 4, 7] = bad  # rank column 4 feeds features 4..9: a value that is read
    expected = reference.lora_matmul(x, poisoned_a, poisoned_b, slots, out_slices)
    assert not torch.isfinite(expected[slots == 2]).all()
    others = slots != 2
    for fn in [reference.lora_matmul, forms.one_hot, forms.grouped] + [cpu_native.lora_matmul] * cpu_native.supported():
        clean = fn(x, lora_a, lora_b, slots, out_slices)
        out = fn(x, poisoned_a, poisoned_b, slots, out_slices)
        assert torch.equal(out[others], clean[others]), fn.__name__
        assert out[slots == 0].abs().max() == 0
        ops.SPEC.assert_close(out[others], expected[others], fn.__name__)
