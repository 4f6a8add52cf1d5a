"""The W8A8 matmul (INT8 weights, INT8 activations quantized per token): the Pallas kernel
against THE reference on generated cases in TPU interpret mode, its cost estimate against a
walk of its grid's fetches, libtpu compiling it for v5e and v6e at Llama-3.1-8B's shapes; the
native path's provider (``torch._int_mm``) against the reference."""
from __future__ import annotations

import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases, in_fresh_process
from tpu_executor.kernels.w8a8_matmul import ops

CASES = 8


def interpret_and_compile() -> dict:
    """{"interpreted": labels of the cases checked, "compiled": {(target, shape): custom call}}."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.kernels.w8a8_matmul.kernel import w8a8_matmul
    from tpu_executor.worker.jax.target import target_devices

    labels = []
    for case in generated_cases(ops.SPEC, seed=4)[:CASES]:
        x, weight, scale = case.args
        out = w8a8_matmul(jnp.asarray(x.float().numpy()).astype(str(x.dtype).removeprefix("torch.")),
                          jnp.asarray(weight.numpy()), jnp.asarray(scale.numpy()), interpret=True)
        got = torch.tensor(np.asarray(out.astype(jnp.float32))).to(x.dtype)
        ops.SPEC.assert_close(got, case.run(ops.SPEC.reference), case.label)
        labels.append(case.label)
    compiled, shape = {}, jax.ShapeDtypeStruct
    for target in ("v5e-1", "v6e-1"):
        mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse(target))), ("tp",))
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # Llama-3.1-8B: QKV at a 64-row decode, gate/up and down at a 512-token prefill.
        for m, k, n in [(64, 4096, 6144), (512, 4096, 28672), (512, 14336, 4096)]:
            operands = (shape((m, k), jnp.bfloat16, sharding=placed), shape((k, n), jnp.int8, sharding=placed),
                        shape((n,), jnp.float32, sharding=placed))
            text = jax.jit(w8a8_matmul).lower(*operands).compile().as_text()
            compiled[(target, (m, k, n))] = "tpu_custom_call" in text
    return {"interpreted": labels, "compiled": compiled}


@pytest.mark.slow  # interpret mode and libtpu, in a fresh interpreter
def test_the_kernel_matches_the_reference_and_compiles_for_v5e_and_v6e():
    found = in_fresh_process(interpret_and_compile)
    labels = found["interpreted"]
    assert len(labels) == CASES and any("bfloat16" in label for label in labels)
    assert any("float32" in label for label in labels) and any("t=37" in label for label in labels)
    assert len(found["compiled"]) == 6 and all(found["compiled"].values()), found["compiled"]


def test_the_cost_estimate_counts_the_tiles_the_grid_fetches():
    from tpu_executor.kernels.w8a8_matmul.kernel import cost_estimate
    from tpu_executor.kernels.w8a16_matmul.kernel import tiles

    for m, k, n in [(64, 4096, 6144), (512, 2048, 1024), (16, 1024, 2048)]:
        tm, tk, tn = tiles(m, k, n, k, 1)
        blocks, fetched = {}, 0
        for i in range(m // tm):
            for j in range(n // tn):
                for s in range(k // tk):
                    wanted = {"x": ((i, s), tm * tk), "x_scale": ((i, 0), tm * 4), "w": ((s, j), tk * tn),
                              "w_scale": ((0, j), tn * 4)}
                    for operand, (index, size) in wanted.items():
                        if blocks.get(operand) != index:
                            blocks[operand], fetched = index, fetched + size
                fetched += tm * tn * 2  # the bf16 output tile, written once
        assert cost_estimate(m, k, n, (tm, tk, tn), 2).bytes_accessed == fetched, (m, k, n)


def test_the_native_provider_equals_the_reference():
    """``torch._int_mm``'s int32 sums are exact: only the scales' fp32 products may differ."""
    checked = 0
    for case in generated_cases(ops.SPEC, seed=7)[:12]:
        x, weight, scale = case.args
        if x.dtype != torch.float32:
            continue
        assert ops.int_mm_fits(x, weight, scale)
        ops.SPEC.assert_close(ops.int_mm_matmul(x, weight, scale), case.run(ops.SPEC.reference), case.label)
        checked += 1
    assert checked >= 3
