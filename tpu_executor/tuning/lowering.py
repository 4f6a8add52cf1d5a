"""Check that the Pallas attention kernels lower for the TPU at every bucket's shapes.

``jax.jit(...).trace(...).lower(lowering_platforms=("tpu",))`` runs Pallas's Mosaic lowering
on this CPU machine, without a TPU: it rejects block shapes a TPU cannot take, and each
kernel's own ``validate`` checks its VMEM estimate against the budget first. Shapes are one
chip's share: query and KV heads divided by the tensor-parallel degree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from tpu_executor.core.buckets import DecodeGraph, Graph, PrefillGraph
from tpu_executor.tuning.roofline import ModelShape

PAGES = 64  # pages in the lowered cache: its size does not change the kernels' blocks


@dataclass(frozen=True)
class LoweringResult:
    """A graph's kernel lowered for the TPU, or the reason it does not."""

    graph: Graph
    kernel: str
    error: Optional[str] = None


def kernel_support(model: ModelShape, tp: int) -> Optional[str]:
    """Why the Pallas attention kernels cannot serve this model at all (None: they can)."""
    if model.head_dim % 128:
        return f"head_dim {model.head_dim} is not a multiple of 128: attention runs the XLA reference on TPU"
    if model.heads % tp or (model.kv_heads >= tp and model.kv_heads % tp):
        return f"{model.heads} heads / {model.kv_heads} KV heads do not split over {tp} chips"
    return None


def lower_graphs(graphs: Sequence[Graph], model: ModelShape, tp: int, block_size: int,
                 dtype: str = "bfloat16", device_kind: str = "TPU v5 lite") -> List[LoweringResult]:
    """Lower the attention kernel of each prefill and decode graph for a TPU chip of
    ``device_kind`` (JAX's name for it)."""
    import jax
    import jax.numpy as jnp

    from tpu_executor.kernels.tpu_layout import lowering_chip
    from tpu_executor.worker.jax.runtime import cpu_runtime

    cpu_runtime()  # lowering needs no TPU runtime; starting one would hold libtpu

    dt = jnp.dtype(dtype)
    heads, kv_heads = model.heads // tp, max(1, model.kv_heads // tp)
    pages = jax.ShapeDtypeStruct((kv_heads, PAGES, block_size, model.head_dim), dt)
    results = []
    with lowering_chip(device_kind):
        for graph in graphs:
            if isinstance(graph, PrefillGraph):
                results.append(_lower_prefill(graph, heads, pages, model.head_dim, dt))
            elif isinstance(graph, DecodeGraph):
                results.append(_lower_decode(graph, heads, pages, model.head_dim, dt))
    return results


def _lower(kernel_name: str, graph: Graph, fn, *args, **kwargs) -> LoweringResult:
    try:
        lowered = fn.trace(*args, **kwargs).lower(lowering_platforms=("tpu",))
    except Exception as err:  # noqa: BLE001 - any lowering failure drops the bucket, with its reason
        return LoweringResult(graph, kernel_name, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    if "tpu_custom_call" not in lowered.as_text():
        return LoweringResult(graph, kernel_name, "lowered without a Mosaic kernel (tpu_custom_call missing)")
    return LoweringResult(graph, kernel_name)


def _lower_prefill(graph: PrefillGraph, heads: int, pages, head_dim: int, dt) -> LoweringResult:
    import jax
    import jax.numpy as jnp

    from tpu_executor.kernels.prefill_attention.kernel import prefill_attention

    t, keys = graph.num_tokens, graph.keys
    key_ints = [jax.ShapeDtypeStruct((keys,), jnp.int32)] * 3  # slots, positions, segments
    query_ints = [jax.ShapeDtypeStruct((t,), jnp.int32)] * 2
    return _lower("prefill_attention", graph, prefill_attention, jax.ShapeDtypeStruct((t, heads, head_dim), dt),
                  pages, pages, *key_ints, *query_ints, scale=head_dim ** -0.5)


def _lower_decode(graph: DecodeGraph, heads: int, pages, head_dim: int, dt) -> LoweringResult:
    import jax
    import jax.numpy as jnp

    from tpu_executor.kernels.paged_attention.kernel import paged_attention

    rows, q = graph.num_rows, jax.ShapeDtypeStruct((graph.num_tokens, heads, head_dim), dt)
    return _lower("paged_attention", graph, paged_attention, q,
                  pages, pages, jax.ShapeDtypeStruct((rows,), jnp.int32),
                  jax.ShapeDtypeStruct((rows, graph.context_blocks), jnp.int32), scale=head_dim ** -0.5)
