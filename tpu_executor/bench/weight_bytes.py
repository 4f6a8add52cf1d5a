"""``tpu-executor bench weight-bytes``: the bytes a decode step reads for a model's linear
layers' weights, bf16 against INT8, INT4 and FP8, from the TPU compiler (libtpu, no TPU needed).

Each projection's matmul at a decode's row count (QKV, output, gate/up, down; the LM head and
the embedding are not linear layers here and stay bf16) is compiled for ``--target`` alone,
in each form the engine can run: bf16 (XLA's dot), INT8 and INT4 through the weight-only
Pallas kernel (the compiler takes the kernel's own count of the tiles it fetches: a Mosaic
call is opaque to XLA's cost model), and INT8/INT4 through the references (dequantize, then
dot: whether XLA's fused convert reads the quantized bytes is the compiler's own analysis),
FP8 (an FP8 checkpoint's per-channel weights) through the INT8 reference, the form it runs in.
Prints each form's bytes per decode step over every layer and its ratio to bf16; the whole
step's bytes and the KV-cache blocks that fit come from ``tpu-executor compile``'s report.

    tpu-executor bench weight-bytes --model llama-3.1-8b --target v6e-1 --rows 64
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable, Dict, List, Tuple

from tpu_executor.engine.options import HelpFormatter

GROUP = 128  # INT4's and grouped INT8's input features per scale (the engine's default)


def add_parser(subparsers) -> argparse.ArgumentParser:
    from tpu_executor.tools.published_models import MODEL_SHAPES

    parser = subparsers.add_parser("weight-bytes", help="a decode step's linear-weight bytes, bf16 vs INT8 vs INT4, "
                                                        "from the TPU compiler", description=__doc__,
                                   formatter_class=HelpFormatter)
    parser.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--target", default="v6e-1", help="a TPU slice, e.g. v5e-1, v6e-1")
    parser.add_argument("--rows", type=int, default=64, help="decode rows (sequences) of the step")
    parser.set_defaults(run=run)
    return parser


def projections(config: Dict) -> List[Tuple[str, int, int]]:
    """(name, input features, output features) of one layer's dense projections, packed as
    the engine packs them."""
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    intermediate = config["intermediate_size"]
    return [("qkv", hidden, (heads + 2 * kv_heads) * head_dim), ("o", heads * head_dim, hidden),
            ("gate_up", hidden, 2 * intermediate), ("down", intermediate, hidden)]


def forms() -> Dict[str, Tuple[Callable, Callable]]:
    """{form: (the call on JAX arrays, its operands' shapes for (k, n))}."""
    import jax.numpy as jnp

    from tpu_executor.kernels.w8a16_matmul.kernel import quantized_matmul

    def int8_reference(x, weight, scale):
        return x @ (weight.astype(x.dtype) * scale.astype(x.dtype)[None, :])

    def int4_reference(x, packed, scale):
        stored = packed.astype(jnp.int32)
        q = jnp.concatenate([(stored << 28) >> 28, stored >> 4], axis=0)
        return x @ (q.astype(jnp.float32) * jnp.repeat(scale, GROUP, axis=0)).astype(x.dtype)

    def int8_shapes(k, n):
        return [((k, n), jnp.int8), ((n,), jnp.float32)]  # per output channel, as --quantization int8

    def int4_shapes(k, n):
        return [((k // 2, n), jnp.int8), ((k // GROUP, n), jnp.float32)]  # two a byte, groups of 128

    return {
        "bf16": (lambda x, w: x @ w, lambda k, n: [((k, n), jnp.bfloat16)]),
        "INT8 kernel": (functools.partial(quantized_matmul, bits=8), int8_shapes),
        "INT8 reference": (int8_reference, int8_shapes),
        "INT4 kernel": (functools.partial(quantized_matmul, bits=4), int4_shapes),
        "INT4 reference": (int4_reference, int4_shapes),
        "FP8 reference": (int8_reference, lambda k, n: [((k, n), jnp.float8_e4m3fn), ((n,), jnp.float32)]),
    }


def compiled_bytes(fn: Callable, shapes, placed) -> float:
    """The HBM bytes of ``fn`` over operands of ``shapes`` as the compiler accounts them
    (``hlo_audit.hbm_bytes``: without its own prefetches into VMEM counted again)."""
    import jax

    from tpu_executor.worker.jax.hlo_audit import hbm_bytes

    operands = [jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for shape, dtype in shapes]
    compiled = jax.jit(fn).lower(*operands).compile()
    analysis = compiled.cost_analysis()
    return hbm_bytes(float((analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"]),
                     compiled.as_text())


def run(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.tools.published_models import MODEL_SHAPES
    from tpu_executor.worker.jax.target import target_devices

    config = MODEL_SHAPES[args.model]
    mesh = jax.sharding.Mesh(np.array(target_devices(Target.parse(args.target))[:1]), ("tp",))
    placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    totals = {}
    with jax.set_mesh(mesh):  # Pallas lowers for the chip of the mesh in context
        for form, (fn, weight_shapes) in forms().items():
            per_layer = sum(compiled_bytes(fn, [((args.rows, k), jnp.bfloat16), *weight_shapes(k, n)], placed)
                            for _, k, n in projections(config))
            totals[form] = per_layer * config["num_hidden_layers"]
    print(f"{args.model} on {args.target}, one chip, a decode step of {args.rows} rows, bf16 activations; bytes "
          "the compiler counts for the linear layers (LM head and embedding excluded)")
    print("\n| form | GB per decode step | against bf16 |\n|---|---|---|")
    for form, total in totals.items():
        print(f"| {form} | {total / 1e9:.2f} | {total / totals['bf16']:.2f}x |")
