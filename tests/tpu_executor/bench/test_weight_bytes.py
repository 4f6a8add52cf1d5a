"""``bench weight-bytes``: a model's projections as the engine packs them, and the compiler's
bytes of each form for a small layer (libtpu, a fresh interpreter)."""
import pytest

from tests.pallas_kernels.kernel_cases import in_fresh_process
from tpu_executor.bench.weight_bytes import projections
from tpu_executor.tools.published_models import MODEL_SHAPES


def test_projections_are_the_packed_layers_of_a_decoder_layer():
    assert projections(MODEL_SHAPES["llama-3.1-8b"]) == [
        ("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def layer_bytes() -> dict:
    """{form: bytes} of a 2,048 x 4,096 projection at 64 decode rows on v6e."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.bench.weight_bytes import compiled_bytes, forms
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.worker.jax.target import target_devices

    mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse("v6e-1"))), ("tp",))
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return {form: compiled_bytes(fn, [((64, 2048), jnp.bfloat16), *shapes(2048, 4096)], placed)
            for form, (fn, shapes) in forms().items()}


@pytest.mark.slow  # libtpu compiles six programs
def test_the_kernels_read_the_quantized_bytes_where_the_int4_reference_unpacks():
    found = in_fresh_process(layer_bytes)
    weight = 2048 * 4096 * 2  # the bf16 weight's bytes
    # the weight once (not again for the compiler's prefetch into VMEM), and the activations
    assert weight <= found["bf16"] <= 1.05 * (weight + 64 * (2048 + 4096) * 2)
    assert found["INT8 kernel"] <= 0.6 * found["bf16"] and found["INT4 kernel"] <= 0.35 * found["bf16"]
    assert found["INT4 reference"] > found["bf16"]  # XLA materializes the unpacked weight
    assert found["FP8 reference"] <= 0.6 * found["bf16"]  # XLA's convert reads the FP8 bytes in the dot
