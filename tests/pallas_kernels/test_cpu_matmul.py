"""``packed_matmul``'s C kernel (``cpu_c``: the native path's linear layers) against THE
reference, at the edges of its tiles, panel groups and row blocks, and where it serves."""

import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases
from tpu_executor.kernels import OpRegistry, register_all
from tpu_executor.kernels.packed_matmul import cpu_native
from tpu_executor.kernels.packed_matmul.ops import SPEC
from tpu_executor.kernels.packed_matmul.reference import pack, packed_matmul, unpack

pytestmark = pytest.mark.skipif(not cpu_native.supported(), reason="no C compiler to build the kernel")


def product(rows, in_features, out_features, seed=0, x_stride=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, x_stride or in_features, generator=gen)[:, :in_features]
    return x, torch.randn(in_features, out_features, generator=gen)


def test_pack_keeps_every_weight_and_pads_the_last_panel_with_zeros():
    weight = torch.randn(5, 37)
    panels = pack(weight)
    assert panels.shape == (3, 5, 16) and panels.is_contiguous()
    assert torch.equal(unpack(panels, 37), weight) and not panels[2, :, 5:].any()


def test_generated_cases_match_the_reference():
    cases = [c for c in generated_cases(SPEC, seed=5, count=120) if c.args[0].dtype == torch.float32]
    for case in cases:
        assert cpu_native.supports_args(*case.args, **case.kwargs), case.label
        SPEC.assert_close(case.run(cpu_native.packed_matmul), case.run(packed_matmul), case.label)
    assert {c.args[0].is_contiguous() for c in cases} == {True, False}  # x as a view of wider rows too


def test_every_tile_shape_and_panel_group_remainder():
    """Tiles of 1-8 rows x groups of 1-3 panels, the last panel full or partial."""
    for rows in (1, 2, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64):
        for out_features in (1, 15, 16, 17, 32, 33, 48, 49, 64, 80, 95, 96, 97):
            x, weight = product(rows, 40, out_features, seed=rows * 100 + out_features)
            SPEC.assert_close(cpu_native.packed_matmul(x, pack(weight), out_features=out_features), x @ weight,
                              f"rows={rows} out={out_features}")


@pytest.mark.parametrize("in_features", [576, 1536])
def test_prefill_sized_inputs_run_in_several_row_blocks(in_features):
    """A block holds 256 KiB of x, at least 64 rows (112 rows at 576 features, 64 at 1,536): 300
    rows make 3 and 5 blocks."""
    x, weight = product(300, in_features, 200, seed=in_features, x_stride=in_features + 3)
    # Unit normals summed over 1,536 products in another order: ~1e-4 apart at |y| ~ 40.
    torch.testing.assert_close(cpu_native.packed_matmul(x, pack(weight), out_features=200), x @ weight,
                               atol=1e-3, rtol=1e-5)


def test_no_rows_give_an_empty_product():
    x, weight = product(0, 16, 20)
    assert cpu_native.packed_matmul(x, pack(weight), out_features=20).shape == (0, 20)


def test_the_kernel_serves_untraced_fp32_2d_calls_and_the_reference_the_rest():
    registry = register_all(OpRegistry())
    x, weight = product(4, 32, 48)
    panels = pack(weight)
    assert registry.select("packed_matmul", x, panels, out_features=48).name == "cpu_c"
    assert registry.select("packed_matmul", x.t().contiguous().t(), panels, out_features=48).name == "reference"
    assert registry.select("packed_matmul", x[None], panels, out_features=48).name == "reference"
    assert registry.select("packed_matmul", x.bfloat16(), pack(weight.bfloat16()), out_features=48).name \
        == "reference"
    assert registry.select("packed_matmul", x[:, :16], panels, out_features=48).name == "reference"  # K differs
    assert not cpu_native.supports_args(x, panels, out_features=49)  # more than the panels hold
    empty = torch.zeros(4, 0)
    assert registry.select("packed_matmul", empty, pack(torch.zeros(0, 48)), out_features=48).name == "reference"
