"""The native path's small C kernels around the matmuls (``cpu_c``: RMSNorm with the residual
add, RoPE, the KV-cache write) against THE references, and where each serves."""

import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases
from tpu_executor.kernels import OpRegistry, register_all
from tpu_executor.kernels.rms_norm import cpu_native as norm_native
from tpu_executor.kernels.rms_norm.ops import SPEC as NORM_SPEC
from tpu_executor.kernels.rms_norm.ops import fused_rms_norm
from tpu_executor.kernels.rotary_embedding import cpu_native as rotary_native
from tpu_executor.kernels.rotary_embedding.ops import SPEC as ROTARY_SPEC
from tpu_executor.kernels.write_kv_cache import cpu_native as write_native
from tpu_executor.kernels.write_kv_cache.ops import SPEC as WRITE_SPEC

pytestmark = pytest.mark.skipif(not (norm_native.supported() and rotary_native.supported()
                                     and write_native.supported()), reason="no C compiler to build the kernels")


def fp32_cases(spec, seed):
    return [c for c in generated_cases(spec, seed=seed, count=120) if c.args[0].dtype == torch.float32]


def test_rms_norm_matches_the_reference_with_and_without_the_residual_add():
    cases = fp32_cases(NORM_SPEC, seed=1)
    for case in cases:
        assert norm_native.supports_args(*case.args, **case.kwargs), case.label
        actual, expected = case.run(norm_native.rms_norm), case.run(NORM_SPEC.reference)
        if case.kwargs["residual"] is None:
            NORM_SPEC.assert_close(actual, expected, case.label)
            continue
        NORM_SPEC.assert_close(actual[0], expected[0], case.label)
        assert torch.equal(actual[1], expected[1]), case.label  # the sum itself is exact
    kinds = {(c.kwargs["unit_offset"], c.kwargs["residual"] is None, c.args[0].shape[-1] % 16 == 0) for c in cases}
    assert len(kinds) == 8  # both weight conventions x residual or not x width with a tail or not


def test_torchs_fused_rms_norm_is_bit_identical_to_the_reference_in_fp32():
    for case in fp32_cases(NORM_SPEC, seed=2):
        actual, expected = case.run(fused_rms_norm), case.run(NORM_SPEC.reference)
        if case.kwargs["residual"] is None:
            actual, expected = (actual,), (expected,)
        assert all(torch.equal(a, e) for a, e in zip(actual, expected)), case.label


def test_rotary_embedding_is_bit_identical_to_the_reference():
    cases = fp32_cases(ROTARY_SPEC, seed=3)
    for case in cases:
        assert rotary_native.supports_args(*case.args), case.label
        assert torch.equal(case.run(rotary_native.rotary_embedding), case.run(ROTARY_SPEC.reference)), case.label
    assert {c.args[0].is_contiguous() for c in cases} == {True, False}  # views of a QKV row among them


def run_on_copies(fn, case):
    """The caches ``fn`` leaves after writing ``case``'s keys and values into copies of them."""
    k, v, k_cache, v_cache, slots = case.args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    fn(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


def test_write_kv_cache_writes_what_the_reference_writes():
    cases = fp32_cases(WRITE_SPEC, seed=4)
    for case in cases:
        assert write_native.supports_args(*case.args), case.label
        for actual, expected in zip(run_on_copies(write_native.write_kv_cache, case),
                                    run_on_copies(WRITE_SPEC.reference, case)):
            assert torch.equal(actual, expected), case.label
        assert not torch.equal(run_on_copies(write_native.write_kv_cache, case)[0], case.args[2])  # it wrote


def test_a_slot_outside_the_cache_raises_and_writes_nothing():
    k_cache, v_cache = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, 8)
    k = v = torch.ones(3, 2, 8)
    for bad in (12, -1):
        with pytest.raises(ValueError, match=f"token 2's KV-cache slot {bad} is outside the cache's 12 slots"):
            write_native.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 5, bad]))
        assert not k_cache.any() and not v_cache.any()


def test_the_c_kernels_serve_fp32_cpu_calls_and_the_others_fall_back():
    registry = register_all(OpRegistry())
    x, weight = torch.randn(4, 64), torch.ones(64)
    assert registry.select("rms_norm", x, weight, eps=1e-6).name == "cpu_c"
    assert registry.select("rms_norm", x, weight, eps=1e-6, residual=x[:2]).name == "eager_fused"  # shapes differ
    assert registry.select("rms_norm", x.bfloat16(), weight.bfloat16(), eps=1e-6).name == "reference"
    heads, angles = torch.randn(4, 3, 64), torch.randn(4, 1, 64)
    assert registry.select("rotary_embedding", heads, angles, angles).name == "cpu_c"
    assert registry.select("rotary_embedding", heads.transpose(0, 1), angles, angles).name == "reference"
    k_cache = torch.zeros(3, 2, 4, 64)
    args = (heads, heads, k_cache, k_cache.clone(), torch.arange(4))
    assert registry.select("write_kv_cache", *args).name == "cpu_c"
    assert registry.select("write_kv_cache", *args[:4], torch.arange(4, dtype=torch.int32)).name == "reference"
