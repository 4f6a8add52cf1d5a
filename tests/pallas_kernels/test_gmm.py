"""gmm: our Pallas kernel (TPU interpret mode) against THE reference, JAX's megablox, and the
call_jax binding inside a torch_xla graph."""
import pytest
import torch

from tests.pallas_kernels.kernel_cases import (
    INTERPRETED_CASES,
    check_kernel_against_reference,
    check_kernels_agree,
    generated_cases,
    in_fresh_process,
    in_fresh_processes,
    total_counts,
    value_error_of,
)
from tpu_executor.kernels import OpRegistry, Provider
from tpu_executor.kernels.gmm import kernel, ops, reference

pytestmark = pytest.mark.slow  # TPU interpret mode

CASES = generated_cases(ops.SPEC, seed=0, count=INTERPRETED_CASES)


def test_reference_is_a_matmul_per_group():
    lhs, rhs = torch.randn(7, 4), torch.randn(3, 4, 5)
    out = reference.gmm(lhs, rhs, torch.tensor([2, 0, 4], dtype=torch.int32))
    torch.testing.assert_close(out[:2], lhs[:2] @ rhs[0])
    torch.testing.assert_close(out[2:6], lhs[2:6] @ rhs[2])
    assert out[6].abs().max() == 0  # past the last group


def check_generated_cases(indices):
    return check_kernel_against_reference(ops.SPEC, kernel.gmm, CASES, indices=indices)


def test_kernel_matches_reference_on_generated_cases():
    seen = total_counts(in_fresh_processes(check_generated_cases, len(CASES)))
    assert sum(seen.values()) == INTERPRETED_CASES and min(seen.values()) >= 5, seen  # both dtypes
    labels = " ".join(case.label for case in CASES)
    assert "T=True" in labels and "T=False" in labels and ", 0," in labels  # empty groups ran
    assert "int8" in labels and "int4 zero=True" in labels and "int4 zero=False" in labels  # quantized experts


def compare_with_megablox(indices):
    """Where megablox accepts the shapes (m a multiple of tm; no INT8 experts), both kernels
    give the same rows."""
    cases = [CASES[i] for i in indices if len(CASES[i].args) == 3
             and not ops.shape_problem(*CASES[i].args, require_whole_tiles=True, **CASES[i].kwargs)]
    return check_kernels_agree(ops.SPEC, kernel.gmm, ops._megablox_gmm, cases)


def test_kernel_agrees_with_jax_megablox():
    assert sum(in_fresh_processes(compare_with_megablox, 12)) >= 6


@pytest.mark.parametrize("shapes, dtype, message", [
    ((64, 100, 128, 2), "float32", None),  # k=100 is one whole block: allowed
    ((64, 200, 128, 2), "float32", None),
    ((64, 128, 128, 2), "float16", "gmm supports"),
])
def test_validate_names_the_constraint(shapes, dtype, message):
    m, k, n, groups = shapes
    tiling = kernel.choose_tiling(m, k, n, "float32")
    if message is None:
        kernel.validate(m, k, n, groups, dtype, tiling)
        return
    with pytest.raises(ValueError, match=message):
        kernel.validate(m, k, n, groups, dtype, tiling)


@pytest.mark.parametrize("tiling, message", [
    ((24, 128, 128), "multiple of 16"),   # bf16 rows pack two per sublane
    ((32, 192, 128), "tk=192"),           # not a multiple of 128 and not all of k
    ((2048, 2048, 1024), "VMEM"),
])
def test_kernel_rejects_illegal_tiling(tiling, message):
    with pytest.raises(ValueError, match=message):
        kernel.validate(32, 2048, 1024, 2, "bfloat16", tiling)


def call_with_illegal_tiling():
    import jax.numpy as jnp

    lhs, rhs = jnp.zeros((32, 256), jnp.float32), jnp.zeros((2, 256, 128), jnp.float32)
    return value_error_of(lambda: kernel.gmm(lhs, rhs, jnp.array([16, 16], jnp.int32),
                                             tiling=(32, 192, 128), interpret=True))


def test_direct_call_raises_a_clear_error():
    assert "tk=192 must divide k=256" in in_fresh_process(call_with_illegal_tiling)


def test_unsupported_args_fall_back_to_the_reference():
    """A provider that would run (forced supported) still declines what breaks its
    constraints, and the registry falls back."""
    registry = OpRegistry()
    registry.register("gmm", Provider("pallas", lambda *a, **k: "pallas", priority=20,
                                      supports_args=lambda *a, **k: ops.shape_problem(*a, **k) is None))
    registry.register("gmm", Provider("reference", lambda *a, **k: "reference", priority=0,
                                      is_reference=True))
    sizes = torch.tensor([4, 4], dtype=torch.int32)
    assert registry.dispatch("gmm", torch.zeros(8, 128), torch.zeros(2, 128, 128), sizes) == "pallas"
    assert registry.dispatch("gmm", torch.zeros(8, 128), torch.zeros(2, 128, 128),
                             sizes.long()) == "reference"
    assert "int32" in ops.shape_problem(torch.zeros(8, 128), torch.zeros(2, 128, 128), sizes.long())


def test_call_jax_binding_inside_a_torch_xla_graph():
    """Our kernel in plain interpret mode, called on XLA tensors eagerly and under
    torch.compile(openxla), matches the reference; a second compiled call does not recompile."""
    import torch_xla
    import torch_xla.debug.metrics as met

    case = next(c for c in CASES if c.args[0].dtype == torch.float32 and c.args[0].shape[0] >= 64)
    device = torch_xla.device()
    args = [t.to(device) for t in case.args]  # quantized experts bring their scales (and zeros)
    op = ops.pallas_op()
    expected = case.run(reference.gmm)
    ops.SPEC.assert_close(op(*args, interpret=True, **case.kwargs).cpu(), expected)

    def step(*args):
        return op(*args, interpret=True, **case.kwargs) * 2

    compiled = torch.compile(step, backend="openxla", fullgraph=True, dynamic=False)
    ops.SPEC.assert_close(compiled(*args).cpu(), expected * 2)
    before = met.counter_value("UncachedCompile") or 0
    ops.SPEC.assert_close(compiled(*args).cpu(), expected * 2)
    assert (met.counter_value("UncachedCompile") or 0) == before
