"""The native path's weight-only INT8 and INT4 C kernel (``w8a16_matmul/cpu_quant.c``) against
THE references on the ops' generated fp32 cases, and where it serves."""
import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases
from tpu_executor.kernels import OpRegistry, register_all
from tpu_executor.kernels.w4a16_matmul import ops as w4a16_ops
from tpu_executor.kernels.w8a16_matmul import cpu_native
from tpu_executor.kernels.w8a16_matmul import ops as w8a16_ops

pytestmark = pytest.mark.skipif(not cpu_native.KERNEL.supported(), reason="no C compiler to build the kernel")


def fp32_cases(spec, seed):
    return [c for c in generated_cases(spec, seed=seed, count=80) if c.args[0].dtype == torch.float32]


@pytest.mark.parametrize("spec, form, kernel", [(w8a16_ops.SPEC, cpu_native.INT8, cpu_native.int8_matmul),
                                                (w4a16_ops.SPEC, cpu_native.INT4, cpu_native.int4_matmul)])
def test_the_kernel_matches_the_reference_on_generated_cases(spec, form, kernel):
    cases = fp32_cases(spec, seed=5)
    for case in cases:
        assert form.supports_args(*case.args), case.label
        spec.assert_close(case.run(kernel), case.run(spec.reference), case.label)
    labels = " ".join(c.label for c in cases)
    assert all(f"t={t} " in labels for t in (1, 8, 37))  # one row, a tile, tiles and a short one
    if spec is w8a16_ops.SPEC:
        assert "group=channel" in labels and "group=32" in labels and "n=40 " in labels  # a vector tail too
    else:
        assert "symmetric=False" in labels and "symmetric=True" in labels and "group=32" in labels


def test_the_registry_serves_fp32_cpu_calls_with_it_and_bf16_with_the_reference():
    registry = register_all(OpRegistry())
    case = fp32_cases(w4a16_ops.SPEC, seed=5)[0]
    assert registry.select("w4a16_matmul", *case.args).name == "cpu_c"
    bf16 = (case.args[0].to(torch.bfloat16),) + case.args[1:]
    assert registry.select("w4a16_matmul", *bf16).name == "reference"
    x, weight, scale = fp32_cases(w8a16_ops.SPEC, seed=5)[0].args
    assert registry.select("w8a16_matmul", x, weight, scale).name == "cpu_c"
    assert registry.select("w8a16_matmul", x[:, :-1], weight, scale).name == "reference"  # shapes that do not fit
