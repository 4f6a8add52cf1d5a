"""The ``lora_matmul`` op (multi-LoRA): its spec (reference, fake, tolerances, cases) and providers."""
from __future__ import annotations

import numpy as np
import torch

from tpu_executor.kernels import cpu_library
from tpu_executor.kernels.binding import eager_only
from tpu_executor.kernels.lora_matmul import cpu_native, forms, reference
from tpu_executor.kernels.registry import REGISTRY, Provider
from tpu_executor.kernels.spec import OpCase, OpSpec, Tolerance

OP_NAME = "lora_matmul"


def fake(x, lora_a, lora_b, slots, out_slices=None):
    """Output shape and dtype."""
    return x.new_empty(x.shape[0], lora_b.shape[2])


def generate_case(rng: np.random.Generator) -> OpCase:
    """Tokens spread over a few slots (slot 0 among them: no adapter), ranks padded; some
    cases pack projections (B random outside their blocks too: never read)."""
    dtype = torch.bfloat16 if rng.random() < 0.5 else torch.float32
    tokens, num_slots = int(rng.choice([1, 7, 64])), int(rng.choice([2, 5, 9]))
    in_features, out_features = int(rng.choice([64, 96])), int(rng.choice([32, 40, 160]))
    rank = int(rng.choice([8, 16, 48]))
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    lora_a = (torch.randn(num_slots, in_features, rank, generator=gen) / in_features ** 0.5).to(dtype)
    lora_b = (torch.randn(num_slots, rank, out_features, generator=gen) / rank ** 0.5).to(dtype)
    x = torch.randn(tokens, in_features, generator=gen).to(dtype)
    slots = torch.from_numpy(rng.integers(0, num_slots, size=tokens).astype(np.int64))
    out_slices = packed_projections(rng, rank, out_features)
    label = f"t={tokens} slots={num_slots} in={in_features} out={out_features} rank={rank} {dtype} {out_slices}"
    return OpCase((x, lora_a, lora_b, slots), {"out_slices": out_slices}, label)


def packed_projections(rng: np.random.Generator, rank: int, out_features: int):
    """None (one projection), or 2-3 projections over the output features (now and then
    leaving the last 8 to none)."""
    counts = [p for p in (2, 3) if rank % p == 0]
    if not counts or rng.random() < 0.35:
        return None
    projections = int(rng.choice(counts))
    covered = out_features - (8 if rng.random() < 0.25 else 0)
    cuts = [0, *sorted(rng.choice(np.arange(1, covered), size=projections - 1, replace=False).tolist()), covered]
    return tuple((int(a), int(b - a)) for a, b in zip(cuts, cuts[1:]))


SPEC = OpSpec(
    name=OP_NAME, reference=reference.lora_matmul, fake=fake, generate=generate_case,
    # fp32: summation order of two small matmuls. bf16: the output rounding (2**-8).
    tolerances={torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
                torch.bfloat16: Tolerance(atol=2e-2, rtol=2e-2)})


def register(registry=REGISTRY) -> None:
    """The one-hot form for every traced graph (XLA on a TPU or a CPU, both paths); on the
    native path the C kernel (fp32 on a CPU), else the grouped form; the reference last."""
    registry.register(OP_NAME, cpu_library.c_provider(cpu_native, cpu_native.lora_matmul))
    registry.register(OP_NAME, Provider("eager_grouped", forms.grouped, priority=5, supports_args=eager_only))
    registry.register(OP_NAME, Provider("one_hot", forms.one_hot, priority=4))
    registry.register(OP_NAME, Provider("reference", reference.lora_matmul, priority=0, is_reference=True))


def lora_matmul(x, lora_a, lora_b, slots, out_slices=None):
    """Each token's LoRA delta through its slot's adapter; see ``reference.lora_matmul``."""
    return REGISTRY.dispatch(OP_NAME, x, lora_a, lora_b, slots, out_slices=out_slices)
