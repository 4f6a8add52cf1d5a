"""Kernels behind an op registry: one folder per op (reference.py is the spec, ops.py the op).

``register_all()`` fills the shared registry; it runs when an engine starts, not on import.
"""
from tpu_executor.kernels.registry import REGISTRY, OpRegistry, Provider


def register_all(registry: OpRegistry = REGISTRY) -> OpRegistry:
    """Register every op's providers once (later calls only re-run their static checks)."""
    from tpu_executor.kernels.act_and_mul import ops as act_ops
    from tpu_executor.kernels.gmm import ops as gmm_ops
    from tpu_executor.kernels.lora_matmul import ops as lora_ops
    from tpu_executor.kernels.packed_matmul import ops as packed_ops
    from tpu_executor.kernels.paged_attention import ops as paged_ops
    from tpu_executor.kernels.prefill_attention import ops as prefill_ops
    from tpu_executor.kernels.rms_norm import ops as norm_ops
    from tpu_executor.kernels.rotary_embedding import ops as rotary_ops
    from tpu_executor.kernels.w4a16_matmul import ops as w4a16_ops
    from tpu_executor.kernels.w8a8_matmul import ops as w8a8_ops
    from tpu_executor.kernels.w8a16_matmul import ops as w8a16_ops
    from tpu_executor.kernels.write_kv_cache import ops as write_ops

    for module in (act_ops, gmm_ops, lora_ops, packed_ops, paged_ops, prefill_ops, norm_ops, rotary_ops,
                   w4a16_ops, w8a16_ops, w8a8_ops, write_ops):
        if module.OP_NAME not in registry.ops():
            module.register(registry)
    registry.refresh()
    return registry


__all__ = ["REGISTRY", "OpRegistry", "Provider", "register_all"]
