"""CPU matmul forms chosen after loading (``packed_matmul``'s panels or oneDNN's layout on the
native path, ``[out, in]`` for small layers on XLA's CPU backend): same products as ``x @ W``,
the plain weight dropped."""
from __future__ import annotations

import pytest
import torch

from tpu_executor.kernels import register_all
from tpu_executor.kernels.packed_matmul import cpu_native as packed_matmul_cpu
from tpu_executor.models.layers.cpu_matmul import (
    XLA_CPU_OUT_IN_BELOW,
    XLA_CPU_OUT_IN_MIN_ROWS,
    onednn_matmul,
    onednn_packed,
)
from tpu_executor.worker.model_loader import load_model, pack_for_cpu, quantize, use_xla_cpu_forms

TOLERANCE = dict(rtol=1e-5, atol=1e-5)  # fp32, another summation order


def _hidden(model, rows=7):
    return torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(0))


def _products(model, x):
    layer = model.model.layers[0]
    return [layer.self_attn.qkv_proj(x), layer.mlp(x), model.compute_logits(x)]


@pytest.mark.parametrize("panels", [True, False], ids=["panels", "onednn"])
def test_packed_weights_give_the_same_products(checkpoints, monkeypatch, panels):
    """The panels where packed_matmul's C kernel serves here, oneDNN's layout where it does not."""
    if panels and not packed_matmul_cpu.supported():
        pytest.skip("packed_matmul's C kernel does not build here (no compiler or no AVX-512)")
    monkeypatch.setattr(packed_matmul_cpu, "supported", lambda: panels)
    register_all()
    for arch in ("llama", "gemma"):  # untied head, tied embedding
        model = load_model(checkpoints[arch], torch.float32)
        x = _hidden(model)
        expected = _products(model, x)
        assert pack_for_cpu(model) > 0
        for got, want in zip(_products(model, x), expected):
            torch.testing.assert_close(got, want, **TOLERANCE)
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert "weight" not in qkv._parameters and qkv.weight_packed.is_mkldnn != panels
        assert "weight" in model.model.embed_tokens._parameters  # the lookup still needs it
        ids = torch.tensor([3, 1, 4])
        torch.testing.assert_close(model.model.embed_tokens(ids), load_model(checkpoints[arch], torch.float32)
                                   .model.embed_tokens(ids))


@pytest.mark.parametrize("rows", [1, 128, 129, 145, 159, 160])
def test_onednn_matmul_equals_the_plain_product_at_every_row_count(rows):
    """Row counts in oneDNN's slow range run as two products; the result is the same."""
    generator = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(64, 96, generator=generator), torch.randn(rows, 64, generator=generator)
    torch.testing.assert_close(onednn_matmul(x, onednn_packed(weight)), x @ weight, **TOLERANCE)


def test_quantized_and_bf16_weights_are_not_packed(checkpoints):
    quantized = load_model(checkpoints["llama"], torch.float32)
    quantize(quantized, "int8")
    assert all(not hasattr(m, "weight_packed") for m in quantized.modules() if hasattr(m, "weight_q"))
    assert pack_for_cpu(load_model(checkpoints["llama"], torch.bfloat16)) == 0


def test_small_layers_take_the_out_in_form_for_xla_cpu_prefills(checkpoints):
    model = load_model(checkpoints["llama"], torch.float32)
    decode_sized, prefill_sized = _hidden(model, rows=7), _hidden(model, rows=XLA_CPU_OUT_IN_MIN_ROWS)
    expected = [_products(model, x) for x in (decode_sized, prefill_sized)]
    changed = use_xla_cpu_forms(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert changed > 0 and qkv.weight_out_in.shape == (qkv.out_local, model.config.hidden_size)
    for x, wanted in zip((decode_sized, prefill_sized), expected):
        for got, want in zip(_products(model, x), wanted):
            torch.testing.assert_close(got, want, **TOLERANCE)
    qkv.weight.data.zero_()  # only the [out, in] copy can give prefill-sized products now
    assert qkv(prefill_sized).abs().sum() > 0 and qkv(decode_sized).abs().sum() == 0


def test_layers_with_a_side_at_the_threshold_keep_x_at_w():
    from tpu_executor.models.layers.linear import ColumnParallelLinear
    from tpu_executor.models.layers.parallel import SingleRank

    wide = ColumnParallelLinear(64, XLA_CPU_OUT_IN_BELOW, SingleRank())
    narrow = ColumnParallelLinear(64, XLA_CPU_OUT_IN_BELOW - 1, SingleRank())
    assert not wide.use_xla_cpu_form() and "weight_out_in" not in wide._buffers
    assert narrow.use_xla_cpu_form() and "weight_out_in" in narrow._buffers


def test_eigens_slow_case_runs_as_two_half_width_dots():
    from tpu_executor.models.layers.cpu_matmul import splits_features
    from tpu_executor.models.layers.linear import ColumnParallelLinear
    from tpu_executor.models.layers.parallel import SingleRank

    assert splits_features(32, 1536) and splits_features(64, 2048)
    assert not any(splits_features(rows, 1536) for rows in (16, 65, 128))
    assert not any(splits_features(32, features) for features in (1024, 2560, 3072))
    layer = ColumnParallelLinear(1536, 576, SingleRank())
    torch.nn.init.normal_(layer.weight, std=0.02)
    assert layer.use_xla_cpu_form()
    for rows in (8, 32, 200):  # x @ W, the two halves, the [out, in] form
        x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x), x @ layer.weight, **TOLERANCE)
