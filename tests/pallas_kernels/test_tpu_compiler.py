"""Every Pallas kernel compiled by the TPU compiler itself (libtpu, ahead of time, no TPU),
lowered as each path lowers it: a plain ``jax.jit(...).lower()`` (what torch_xla's
``call_jax`` does) and the JAX path's exported kernel call inside a 64-bit program, for a v5e
chip and for one TensorCore of a v7x. The installed libtpu is the one ``jax[tpu]`` pins."""
import importlib.metadata

import pytest

from tests.pallas_kernels.kernel_cases import in_fresh_process

pytestmark = pytest.mark.slow  # libtpu's compiler, in a fresh interpreter

LIBTPU = "0.0.42.1"  # jax[tpu]==0.10.2's pin: the compiler built with jaxlib's XLA


def test_the_installed_libtpu_is_the_one_jax_pins():
    assert importlib.metadata.version("libtpu") == LIBTPU
    assert 'libtpu==0.0.42.*; extra == "tpu"' in importlib.metadata.requires("jax")


def kernel_calls():
    """(name, function, operand shapes) of each kernel at shapes a v5e takes."""
    import functools

    import jax
    import jax.numpy as jnp

    from tpu_executor.kernels.gmm.kernel import gmm
    from tpu_executor.kernels.paged_attention.kernel import paged_attention
    from tpu_executor.kernels.prefill_attention.kernel import prefill_attention

    shape = jax.ShapeDtypeStruct
    pages = shape((2, 64, 16, 128), jnp.bfloat16)
    ints = lambda n: shape((n,), jnp.int32)  # noqa: E731
    return [
        ("paged_attention", functools.partial(paged_attention, scale=0.1),
         (shape((8, 8, 128), jnp.bfloat16), pages, pages, ints(8), shape((8, 32), jnp.int32))),
        # A verify: each of 8 sequences' last token and 4 drafts.
        ("paged_attention verify", functools.partial(paged_attention, scale=0.1),
         (shape((8 * 5, 8, 128), jnp.bfloat16), pages, pages, ints(8), shape((8, 32), jnp.int32))),
        ("prefill_attention", functools.partial(prefill_attention, scale=0.1),
         (shape((128, 8, 128), jnp.bfloat16), pages, pages, ints(256), ints(256), ints(256), ints(128), ints(128))),
        ("gmm", gmm, (shape((256, 256), jnp.bfloat16), shape((4, 256, 512), jnp.bfloat16), ints(4))),
        ("gmm int8", gmm, (shape((256, 256), jnp.bfloat16), shape((4, 256, 512), jnp.int8), ints(4),
                           shape((4, 512), jnp.float32))),
        ("gmm int4", gmm, (shape((256, 512), jnp.bfloat16), shape((4, 256, 512), jnp.int8), ints(4),
                           shape((4, 4, 512), jnp.float32), shape((4, 4, 512), jnp.float32))),
    ]


def compile_each_way(target: str) -> dict:
    """{kernel: (plain lowering compiled, exported call compiled)} for the first device of
    ``target``."""
    import jax
    import numpy as np

    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.kernels.binding import call_exported_kernel, torchax_env
    from tpu_executor.worker.jax.target import target_devices

    mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse(target))[:1]), ("tp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    results = {}
    for name, fn, shapes in kernel_calls():
        placed = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
        with jax.set_mesh(mesh):  # Pallas lowers for the chip of the mesh in context
            plain = jax.jit(fn).lower(*placed).compile()
        # As the JAX path traces (64-bit mode on, the mesh on torchax): the kernel is exported apart.
        with jax.enable_x64(True), torchax_env().override_property(mesh=mesh):
            exported = jax.jit(lambda *a, fn=fn: call_exported_kernel(fn, (), *a)).lower(*placed).compile()
        results[name] = ("tpu_custom_call" in plain.as_text(), "tpu_custom_call" in exported.as_text())
    return results


@pytest.mark.parametrize("target", ["v5e-1", "tpu7x-8"])
def test_every_kernel_compiles_for_a_tpu_both_ways(target):
    assert in_fresh_process(compile_each_way, target) == {
        name: (True, True) for name in ("paged_attention", "paged_attention verify", "prefill_attention",
                                        "gmm", "gmm int8", "gmm int4")}


def compile_quantized_experts() -> dict:
    """{(target, weights, projection): compiled into a TPU custom call} for the grouped matmul
    over Qwen3-30B-A3B's experts (128 of 2,048 -> 2 x 768 and 768 -> 2,048 features), a
    512-row prefill, INT8 (per channel) and INT4 (groups of 128, zero points)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.kernels.gmm.kernel import gmm
    from tpu_executor.worker.jax.target import target_devices

    results = {}
    for target in ("v5e-1", "v6e-1"):
        mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse(target))), ("tp",))
        placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

        def shape(dims, dtype):
            return jax.ShapeDtypeStruct(dims, dtype, sharding=placed)

        for name, k, n in (("gate/up", 2048, 1536), ("down", 768, 2048)):
            forms = {"int8": (shape((128, k, n), jnp.int8), shape((128, n), jnp.float32)),
                     "int4": (shape((128, k // 2, n), jnp.int8), shape((128, k // 128, n), jnp.float32),
                              shape((128, k // 128, n), jnp.float32))}
            for form, weights in forms.items():
                operands = (shape((512, k), jnp.bfloat16), weights[0], shape((128,), jnp.int32), *weights[1:])
                with jax.set_mesh(mesh):
                    text = jax.jit(gmm).lower(*operands).compile().as_text()
                results[(target, form, name)] = "tpu_custom_call" in text
    return results


def test_quantized_experts_compile_for_v5e_and_v6e_at_qwen3_30b_a3b_shapes():
    results = in_fresh_process(compile_quantized_experts)
    assert len(results) == 8 and all(results.values()), results
