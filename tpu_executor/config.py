"""Frozen engine configuration, validated once at construction.

Every config is a frozen dataclass whose ``__post_init__`` checks its own fields and raises a
``ValueError`` that names the field and says what to change. ``EngineConfig`` checks the
relations between them (e.g. buckets versus the model's context length).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from tpu_executor.compilation import effective_buckets

DEVICES = ("xla", "cpu")
DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("int8",)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _sorted_positive(name: str, values: Tuple[int, ...]) -> Tuple[int, ...]:
    values = tuple(int(v) for v in values)
    _require(len(values) > 0, f"{name} must list at least one bucket")
    _require(all(v > 0 for v in values), f"{name} must be positive integers, got {values}")
    _require(len(set(values)) == len(values), f"{name} has duplicate buckets: {values}")
    return tuple(sorted(values))


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how.

    ``model`` is a directory in Hugging Face layout (config.json, *.safetensors, tokenizer).
    ``max_model_len`` caps prompt + output tokens; ``None`` takes the checkpoint's limit.
    ``quantization="int8"`` stores the linear and expert weights as INT8 with one scale per
    output channel, quantized at load time (weight-only: activations stay in ``dtype``).
    """

    model: str
    dtype: str = "float32"
    max_model_len: Optional[int] = None
    seed: int = 0
    quantization: Optional[str] = None

    def __post_init__(self):
        _require(isinstance(self.model, str) and self.model != "", "model must be a checkpoint path")
        _require(os.path.isdir(self.model),
                 f"model path {self.model!r} is not a directory; pass a Hugging Face checkpoint "
                 "directory (run scripts/prepare_default_model.py for the default one)")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.max_model_len is None or self.max_model_len > 0,
                 f"max_model_len must be positive, got {self.max_model_len}")
        _require(self.quantization in (None,) + QUANTIZATIONS,
                 f"quantization must be None or one of {QUANTIZATIONS}, got {self.quantization!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and how much memory it may take.

    On CPU the cache is sized from ``memory_budget_bytes`` (after the weights and a profiling
    run); on TPU from ``xm.get_memory_info`` times ``memory_utilization``. ``num_blocks`` fixes
    the count outright (tests use it to make preemption happen).
    """

    block_size: int = 16
    memory_utilization: float = 0.9
    memory_budget_bytes: int = 2 << 30
    num_blocks: Optional[int] = None
    enable_prefix_caching: bool = True

    def __post_init__(self):
        _require(self.block_size in (8, 16, 32, 64, 128),
                 f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _require(0.0 < self.memory_utilization <= 1.0,
                 f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        _require(self.memory_budget_bytes > 0, "memory_budget_bytes must be positive")
        _require(self.num_blocks is None or self.num_blocks >= 2,
                 f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits for one engine step."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048

    def __post_init__(self):
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens > 0,
                 f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class CompileConfig:
    """Bucketed static shapes and the compile cache.

    ``prefill_buckets`` are padded token counts of one prefill call, which packs up to
    ``max_prefill_seqs`` prompts (their cached + new tokens); ``decode_buckets`` are
    padded decode batch sizes; ``decode_context_buckets`` pad the longest context of a decode
    batch (the attention reads that many cache slots per sequence). Each list is cut at the
    engine's limit (max_model_len, max_num_seqs), which becomes its last bucket; prefill
    buckets above max_model_len are kept (they hold several prompts). ``strict`` makes any compilation after warm-up an error.
    ``cache_dir`` holds the persistent XLA cache (``None`` disables it).
    """

    prefill_buckets: Tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    decode_buckets: Tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context_buckets: Tuple[int, ...] = (512, 2048)
    strict: bool = False
    cache_dir: Optional[str] = field(
        default_factory=lambda: os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "xla"))
    max_logprobs: int = 20
    max_prefill_seqs: int = 8

    def __post_init__(self):
        object.__setattr__(self, "prefill_buckets", _sorted_positive("prefill_buckets", self.prefill_buckets))
        object.__setattr__(self, "decode_buckets", _sorted_positive("decode_buckets", self.decode_buckets))
        object.__setattr__(self, "decode_context_buckets",
                           _sorted_positive("decode_context_buckets", self.decode_context_buckets))
        _require(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        _require(self.max_prefill_seqs >= 1, f"max_prefill_seqs must be >= 1, got {self.max_prefill_seqs}")


@dataclass(frozen=True)
class DeviceConfig:
    """``"xla"`` runs compiled graphs through torch_xla (TPU, or XLA's CPU backend);
    ``"cpu"`` is the native eager torch path."""

    device: str = "xla"

    def __post_init__(self):
        _require(self.device in DEVICES, f"device must be one of {DEVICES}, got {self.device!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` workers (one per TPU chip), each an actor
    of the Ray cluster at ``ray_address`` (``None``: the cluster this process is connected to,
    else a local one). Above 1 the engine runs the Ray executor; 1 runs in-process unless a
    Ray address is given. ``collective_timeout_s`` bounds how long a rank waits for the others
    in a CPU (gloo) collective, so a lost peer cannot hang the rest forever."""

    tensor_parallel_size: int = 1
    ray_address: Optional[str] = None
    collective_timeout_s: float = 60.0

    def __post_init__(self):
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        _require(self.collective_timeout_s > 0,
                 f"collective_timeout_s must be positive, got {self.collective_timeout_s}")

    @property
    def uses_ray(self) -> bool:
        return self.tensor_parallel_size > 1 or self.ray_address is not None


@dataclass(frozen=True)
class EngineConfig:
    """All configs together, with the cross-checks between them.

    ``max_model_len`` here is resolved (never ``None``); see ``resolve_max_model_len``.
    """

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    device: DeviceConfig
    max_model_len: int
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self):
        block = self.cache.block_size
        bad = [b for b in self.compile.prefill_buckets if b % block]
        _require(not bad, f"prefill_buckets {bad} are not multiples of block_size {block}")
        bad = [b for b in self.compile.decode_context_buckets if b % block]
        _require(not bad, f"decode_context_buckets {bad} are not multiples of block_size {block}")
        _require(self.scheduler.max_num_batched_tokens >= self.max_model_len,
                 f"max_num_batched_tokens {self.scheduler.max_num_batched_tokens} is below "
                 f"max_model_len {self.max_model_len}: a full-length prompt could never run")

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.cache.block_size)

    @property
    def prefill_buckets(self) -> Tuple[int, ...]:
        """Padded prefill token counts; at least one covers ``max_model_len``."""
        buckets = self.compile.prefill_buckets
        if buckets[-1] >= self.max_model_len:
            return buckets
        return effective_buckets(buckets, self.max_model_len, self.cache.block_size)

    @property
    def decode_batch_buckets(self) -> Tuple[int, ...]:
        """Padded decode batch sizes, the last one ``max_num_seqs``."""
        return effective_buckets(self.compile.decode_buckets, self.scheduler.max_num_seqs)

    @property
    def decode_context_blocks(self) -> Tuple[int, ...]:
        """Padded block-table widths of a decode batch, the last one covering ``max_model_len``."""
        tokens = effective_buckets(self.compile.decode_context_buckets, self.max_model_len,
                                   self.cache.block_size)
        return tuple(t // self.cache.block_size for t in tokens)


def resolve_max_model_len(checkpoint_limit: int, user_limit: Optional[int],
                          prefill_buckets: Tuple[int, ...]) -> int:
    """The context length the engine serves: the user's value, else the checkpoint's limit
    capped by the largest prefill bucket."""
    if user_limit is None:
        return min(checkpoint_limit, prefill_buckets[-1])
    _require(user_limit <= checkpoint_limit,
             f"max_model_len {user_limit} exceeds the checkpoint's context length {checkpoint_limit}")
    return user_limit
