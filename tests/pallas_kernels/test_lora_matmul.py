"""``lora_matmul``: the one-hot form (traced graphs) and the grouped form (eager calls) against
THE reference on generated cases; tokens of slot 0 get no update whatever slot 0 holds."""
import torch

from tests.pallas_kernels.kernel_cases import NUM_CASES, generated_cases
from tpu_executor.kernels.lora_matmul import forms, ops, reference


def test_both_forms_match_the_reference_on_generated_cases():
    cases = generated_cases(ops.SPEC, seed=2)
    for case in cases:
        expected = case.run(reference.lora_matmul)
        for form in (forms.one_hot, forms.grouped):
            ops.SPEC.assert_close(case.run(form), expected, f"{form.__name__} {case.label}")
    assert len(cases) == NUM_CASES
    assert {c.args[0].dtype for c in cases} == {torch.float32, torch.bfloat16}
    assert any(len(set(c.args[3].tolist())) > 2 for c in cases)  # several adapters in one call


def test_slot_zero_is_the_base_model():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen)
    lora_a, lora_b = torch.randn(3, 8, 4, generator=gen), torch.randn(3, 4, 5, generator=gen)
    slots = torch.tensor([0, 1, 2, 0, 2, 1])
    for fn in (reference.lora_matmul, forms.one_hot, forms.grouped):
        out = fn(x, lora_a, lora_b, slots)
        assert out[slots == 0].abs().max() == 0
        torch.testing.assert_close(out[1], (x[1] @ lora_a[1]) @ lora_b[1])
