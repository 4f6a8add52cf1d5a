"""The ``write_kv_cache`` op (the step's keys and values into the paged caches): its spec and
providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance
from tpu_executor.kernels.write_kv_cache import cpu_native, reference

OP_NAME = "write_kv_cache"


def fake(k, v, k_cache, v_cache, slot_mapping):
    """Nothing: the op writes into the caches."""
    return None


def generate_case(rng: np.random.Generator) -> OpCase:
    """Distinct slots anywhere in the caches; k and v as views of a QKV-like row or contiguous."""
    dtype = torch.bfloat16 if rng.random() < 0.25 else torch.float32
    kv_heads, d, block_size = int(rng.integers(1, 5)), int(rng.choice([8, 64, 96])), int(rng.choice([4, 16]))
    num_blocks = int(rng.integers(2, 20))
    tokens = int(rng.integers(1, num_blocks * block_size + 1))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    qkv = torch.randn(tokens, 3 * kv_heads, d, generator=gen).to(dtype)
    k, v = (qkv[:, kv_heads:2 * kv_heads], qkv[:, 2 * kv_heads:]) if rng.random() < 0.5 else \
        (qkv[:, :kv_heads].contiguous(), qkv[:, kv_heads:2 * kv_heads].contiguous())
    k_cache, v_cache = (torch.randn(kv_heads, num_blocks, block_size, d, generator=gen).to(dtype) for _ in range(2))
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:tokens].astype(np.int64))
    label = f"tokens={tokens} kv_heads={kv_heads} d={d} blocks={num_blocks}x{block_size} {dtype}"
    return OpCase((k, v, k_cache, v_cache, slots), {}, label)


SPEC = OpSpec(
    name=OP_NAME, reference=reference.write_kv_cache, fake=fake, generate=generate_case,
    # A copy: exact in every dtype.
    tolerances={torch.float32: Tolerance(atol=0.0, rtol=0.0), torch.bfloat16: Tolerance(atol=0.0, rtol=0.0)})


def register(registry=REGISTRY) -> None:
    """The C kernel for untraced fp32 CPU calls (the native path), the reference everywhere
    else (a traced graph's scatter is one XLA op)."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.write_kv_cache))
    registry.register(OP_NAME, Provider("reference", reference.write_kv_cache, priority=0, is_reference=True))


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write k, v ``[T, kv_heads, d]`` into the caches at ``slot_mapping``; see
    ``reference.write_kv_cache``."""
    REGISTRY.dispatch(OP_NAME, k, v, k_cache, v_cache, slot_mapping)
