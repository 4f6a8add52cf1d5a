"""The weight-only quantized matmul kernel (INT8 per channel or in groups, INT4 symmetric or
with zero points) against THE references on generated cases in TPU interpret mode, directly
and through torch_xla's binding (the JAX path's provider: ``test_jax_providers.py``); its cost
estimate against a count of the tiles its grid fetches; libtpu compiles it for v5e and v6e at
Llama-3.1-8B's decode and prefill shapes."""
from __future__ import annotations

import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases, in_fresh_process
from tpu_executor.kernels.w4a16_matmul import ops as w4a16_ops
from tpu_executor.kernels.w8a16_matmul import ops as w8a16_ops

pytestmark = pytest.mark.slow  # interpret mode and libtpu, in a fresh interpreter

CASES_PER_OP = 8


def kernel_cases(spec):
    """The first generated cases whose shapes the kernel takes (groups of whole lanes)."""
    from tpu_executor.kernels.w8a16_matmul.kernel import problem

    taken = []
    for case in generated_cases(spec, seed=4):
        x, weight, scale = case.args[:3]
        group = x.shape[1] if scale.dim() == 1 else x.shape[1] // scale.shape[0]
        if problem(x.shape[0], weight.shape[0], weight.shape[1], group, x.element_size()) is None:
            taken.append(case)
    return taken[:CASES_PER_OP]


def run_interpreted() -> list:
    """(op, label) of every kernel case, each checked against its reference."""
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.kernels.w8a16_matmul.kernel import quantized_matmul

    def on_jax(t):
        return jnp.asarray(t.float().numpy()).astype(str(t.dtype).removeprefix("torch."))

    results = []
    for spec, bits in ((w8a16_ops.SPEC, 8), (w4a16_ops.SPEC, 4)):
        for case in kernel_cases(spec):
            args = [on_jax(a) if a.is_floating_point() else jnp.asarray(a.numpy()) for a in case.args]
            out = quantized_matmul(*args, bits=bits, interpret=True).astype(jnp.float32)
            got = torch.from_numpy(np.asarray(out)).to(case.args[0].dtype)
            spec.assert_close(got, case.run(spec.reference), case.label)
            results.append((spec.name, case.label))
    return results


def test_the_kernel_matches_the_references_in_interpret_mode():
    results = in_fresh_process(run_interpreted)
    labels = [label for _, label in results]
    assert sum(name == "w8a16_matmul" for name, _ in results) == CASES_PER_OP
    assert sum(name == "w4a16_matmul" for name, _ in results) == CASES_PER_OP
    assert any("group=channel" in label for label in labels) and any("group=128" in label for label in labels)
    assert any("symmetric=False" in label for label in labels) and any("symmetric=True" in label for label in labels)
    assert any("bfloat16" in label for label in labels) and any("float32" in label for label in labels)


def test_the_cost_estimate_counts_the_tiles_the_grid_fetches():
    """Walk the grid as the pipeline does (a block is fetched when its index changes) and add
    up each operand's bytes: the estimate must equal it."""
    import jax.numpy as jnp

    from tpu_executor.kernels.w8a16_matmul.kernel import cost_estimate, tiles

    for m, k, n, bits in [(64, 4096, 6144, 4), (512, 2048, 1024, 8), (16, 1024, 2048, 4)]:
        k_rows = k // 2 if bits == 4 else k
        tm, tk, tn = tiles(m, k_rows, n, 128)
        assert n // tn <= 3  # as wide as VMEM allows: x is fetched again for each n-tile
        steps, halves = k_rows // tk, 2 if bits == 4 else 1
        scale, zero = jnp.zeros((k // 128, n), jnp.float32), jnp.zeros((k // 128, n), jnp.float32)
        blocks = {}  # operand -> (last index, bytes fetched)
        fetched = 0
        for i in range(m // tm):
            for j in range(n // tn):
                for s in range(steps):
                    wanted = {("w",): ((s, j), tk * tn)}
                    for h in range(halves):
                        wanted[("x", h)] = ((i, s + h * steps), tm * tk * 2)
                        per_tile = tk // 128
                        wanted[("scale", h)] = ((s + h * steps, j), per_tile * tn * 4)
                        wanted[("zero", h)] = ((s + h * steps, j), per_tile * tn * 4)
                    for operand, (index, size) in wanted.items():
                        if blocks.get(operand) != index:
                            blocks[operand] = index
                            fetched += size
                fetched += tm * tn * 2  # the output tile, written once
        estimate = cost_estimate(m, k, n, k_rows, (tm, tk, tn), 2, scale, zero)
        assert estimate.bytes_accessed == fetched, (m, k, n, bits)


def compile_for_tpus() -> dict:
    """{(target, shape, form): whether libtpu compiled the kernel into a TPU custom call}."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.kernels.w8a16_matmul.kernel import quantized_matmul
    from tpu_executor.worker.jax.target import target_devices

    shape, results = jax.ShapeDtypeStruct, {}
    for target in ("v5e-1", "v6e-1"):
        mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse(target))), ("tp",))
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        # Llama-3.1-8B: QKV and down projections at a 64-row decode, gate/up at a 512-token prefill.
        for m, k, n in [(64, 4096, 6144), (64, 14336, 4096), (512, 4096, 28672)]:
            for form, bits in (("int8 per channel", 8), ("int8 groups", 8), ("int4", 4), ("int4 zeros", 4)):
                weight = shape((k, n) if bits == 8 else (k // 2, n), jnp.int8, sharding=placed)
                scale = shape((n,) if form == "int8 per channel" else (k // 128, n), jnp.float32, sharding=placed)
                extra = (shape((k // 128, n), jnp.float32, sharding=placed),) if form == "int4 zeros" else ()
                x = shape((m, k), jnp.bfloat16, sharding=placed)
                compiled = jax.jit(functools.partial(quantized_matmul, bits=bits)).lower(x, weight, scale, *extra)
                results[(target, (m, k, n), form)] = "tpu_custom_call" in compiled.compile().as_text()
    return results


def test_libtpu_compiles_every_form_for_v5e_and_v6e_at_8b_shapes():
    results = in_fresh_process(compile_for_tpus)
    assert len(results) == 24 and all(results.values()), [key for key, ok in results.items() if not ok]


def test_the_torch_xla_binding_matches_the_reference_eagerly_and_compiled():
    """Both ops' torch_xla binding (interpret mode) on XLA tensors, eagerly and under
    torch.compile(openxla), INT4 with and without zero points: the reference's products."""
    import torch_xla

    from tpu_executor.kernels.w8a16_matmul import binding

    device = torch_xla.device()
    for spec, ops_module, bits in ((w8a16_ops.SPEC, w8a16_ops, 8), (w4a16_ops.SPEC, w4a16_ops, 4)):
        op = binding.torch_op(ops_module.OP_NAME, bits, ops_module.fake)
        cases = [c for c in kernel_cases(spec) if c.args[0].dtype == torch.float32][:2]
        for case in cases:
            args = [a.to(device) for a in case.args]
            expected = case.run(spec.reference)
            spec.assert_close(op(*args, interpret=True).cpu(), expected, case.label)
            compiled = torch.compile(lambda *a: op(*a, interpret=True) * 2, backend="openxla", fullgraph=True)
            spec.assert_close(compiled(*args).cpu(), expected * 2, case.label)
        assert len(cases) == 2
