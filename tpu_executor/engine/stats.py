"""``EngineStats``: one snapshot of everything the engine measures about itself.

The benchmark, the tests, the coming ``/metrics`` endpoint and the tuning tool all read this
one object; nothing reaches into workers or runners for figures.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Tuple

from tpu_executor.core.buckets import BucketPlan
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.speculative import SpecCounts
from tpu_executor.core.step import PaddingStats


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's figures (counters since start-up, gauges at the moment).

    Start-up: ``startup_seconds`` per phase (init_device, load_model, profile, init_cache,
    warmup). Compilation: graphs compiled at warm-up and after it (the worst rank's; after
    warm-up must stay 0). Padding of the bucketed shapes. Scheduling: preemptions,
    prefix-cache queries and hits (tokens, counted at admission), sequences running and
    waiting. KV cache: blocks in use and in all, and the bytes of one worker's cache. The
    persistent compile cache at warm-up (JAX path): graphs loaded from it, graphs it lacked,
    and the seconds XLA spent compiling or loading (summed over the compile threads). Kernels:
    the provider each op's calls took at warm-up, as (op, provider) pairs (the compiled paths;
    the native path compiles nothing at warm-up and chooses per call). Speculative decoding:
    verifies, draft tokens, accepted drafts and accepted drafts per draft position. Multi-LoRA:
    the adapter slots that running requests use.
    """

    startup_seconds: Dict[str, float] = field(default_factory=dict)
    graphs_compiled_at_warmup: int = 0
    graphs_compiled_after_warmup: int = 0
    padding: PaddingStats = field(default_factory=PaddingStats)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_cache_bytes: int = 0
    compile_cache_hits: int = 0
    compile_cache_misses: int = 0
    compile_seconds: float = 0.0
    kernel_providers: Tuple[Tuple[str, str], ...] = ()
    spec_decode: SpecCounts = field(default_factory=SpecCounts)
    lora_slots_in_use: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the usable KV blocks held by requests."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def startup_report(config: EngineConfig, stats: EngineStats, seconds: float) -> str:
    """What ``serve`` and ``generate`` print once the engine is ready: the context it serves,
    its KV cache and the bucket plan it compiled."""
    plan = BucketPlan.from_config(config)
    if config.device.is_jax:
        warm = "warm start" if stats.compile_cache_hits and not stats.graphs_compiled_at_warmup else "cold start"
        compiled = (f"{stats.graphs_compiled_at_warmup} graphs compiled and {stats.compile_cache_hits} loaded from "
                    f"the compile cache at warm-up ({warm})")
    elif config.device.is_xla:
        compiled = f"{stats.graphs_compiled_at_warmup} graphs compiled at warm-up"
    else:
        compiled = f"native {config.device.device} path, nothing compiled"
    return (f"engine ready in {seconds:.1f} s: context {config.max_model_len} tokens, {stats.kv_blocks_total} KV "
            f"blocks of {config.cache.block_size} tokens, up to {config.scheduler.max_num_seqs} sequences, "
            f"{compiled}\nbucket plan: {plan.describe()}{kernel_line(stats)}{speculative_line(config)}")


def kernel_line(stats: EngineStats) -> str:
    """The start-up report's line naming each op's provider (empty when none was recorded)."""
    if not stats.kernel_providers:
        return ""
    return "\nkernels: " + ", ".join(f"{op}={provider}" for op, provider in stats.kernel_providers)


def speculative_line(config: EngineConfig) -> str:
    """The start-up report's line naming the speculative config (empty without one)."""
    return "" if config.speculative is None else f"\nspeculative decoding: {config.speculative.describe()}"
