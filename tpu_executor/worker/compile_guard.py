"""The recompilation guard.

XLA compiles one graph per input shape, so every dynamic size is padded up to a bucket of the
plan (``core/buckets.py``) and every graph of the plan is compiled at start-up. After warm-up
the guard reads the path's compile counters (torch_xla's ``UncachedCompile`` and dynamo's
graph count; on the JAX path, JAX's compile events less its persistent-cache hits): any growth
means a shape escaped the buckets. Strict mode raises; default mode logs each time.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, Optional, Tuple

logger = logging.getLogger(__name__)


class RecompilationError(RuntimeError):
    """A graph was compiled after warm-up (strict mode)."""


def compile_counts() -> Tuple[int, int]:
    """(XLA compilations, dynamo graphs) so far in this process."""
    import torch._dynamo.utils
    import torch_xla.debug.metrics as met

    xla = met.counter_value("UncachedCompile") or 0
    dynamo = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return int(xla), int(dynamo)


class JaxCompileEvents:
    """JAX's compile events in this process: programs compiled by XLA, programs loaded from
    the persistent cache instead, and the seconds both took (``jax.monitoring`` listeners)."""

    def __init__(self):
        self.compiled = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def counts(self) -> Tuple[int, int]:
        """(programs compiled, 0): the guard's pair of counters."""
        return self.compiled, 0

    def cache_figures(self) -> Tuple[int, int, float]:
        """(persistent-cache hits, misses, seconds spent compiling or loading) so far."""
        return self.cache_hits, self.cache_misses, self.seconds

    def _on_event(self, event: str, **_) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            with self._lock:
                self.cache_hits += 1
                self.compiled -= 1  # the compile event that wraps the load counted it
        elif event == "/jax/compilation_cache/cache_misses":
            with self._lock:
                self.cache_misses += 1

    def _on_duration(self, event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self._lock:
                self.compiled += 1
                self.seconds += seconds


_JAX_EVENTS: Optional[JaxCompileEvents] = None


def jax_compile_events() -> JaxCompileEvents:
    """The process's JAX compile counters (listening starts on the first call)."""
    global _JAX_EVENTS
    if _JAX_EVENTS is None:
        import jax.monitoring

        _JAX_EVENTS = JaxCompileEvents()
        jax.monitoring.register_event_listener(_JAX_EVENTS._on_event)
        jax.monitoring.register_event_duration_secs_listener(_JAX_EVENTS._on_duration)
    return _JAX_EVENTS


class CompileGuard:
    """Counts the compilations that happen inside this runner's steps after warm-up.

    The counters are process-wide, so the guard only attributes the difference across its own
    calls (another engine in the same process compiling in between does not count).
    """

    def __init__(self, strict: bool, enabled: bool = True, counts: Callable[[], Tuple[int, int]] = compile_counts,
                 cache_figures: Callable[[], Tuple[int, int, float]] = lambda: (0, 0, 0.0)):
        self.strict = strict
        self.enabled = enabled  # False on the native path: nothing compiles, torch_xla stays unloaded
        self.counts = counts
        self.cache_figures = cache_figures
        # At warm-up: persistent-cache hits and misses, seconds compiling or loading (JAX path).
        self.warmup_cache_figures: Tuple[int, int, float] = (0, 0, 0.0)
        self.warmed_up = False
        self.compiled_during_warmup = 0
        self.compiled_after_warmup = 0
        self._warmup_start = (0, 0)

    def begin_warmup(self) -> None:
        if self.enabled:
            self._warmup_start = self.counts()
            self._warmup_cache_start = self.cache_figures()

    def end_warmup(self) -> None:
        if self.enabled:
            self.compiled_during_warmup = self.counts()[0] - self._warmup_start[0]
            self.warmup_cache_figures = tuple(now - then for now, then in
                                              zip(self.cache_figures(), self._warmup_cache_start))
        self.warmed_up = True

    @contextlib.contextmanager
    def watch(self, what: str):
        """Wrap one serving step; raises (strict) or logs if it compiled anything."""
        if not self.enabled:
            yield
            return
        before = self.counts()
        yield
        if not self.warmed_up:
            return
        after = self.counts()
        new = (after[0] - before[0]) + (after[1] - before[1])
        if new == 0:
            return
        self.compiled_after_warmup += new
        message = f"{new} compilation(s) after warm-up in {what}; a shape escaped the buckets"
        if self.strict:
            raise RecompilationError(message)
        logger.warning(message)


class _PlannedGraphs:
    """Graphs planned by every XLA runner of this process so far. Dynamo keeps each compiled
    function's cache entries (one per bucket and model instance) for the process's life, so
    a process that builds engine after engine (tests, benchmarks) needs limits that grow with
    all of them, not with the last plan alone."""

    total = 0


def raise_dynamo_limits(num_graphs: int) -> None:
    """Let dynamo keep one cache entry per bucket of every plan (its default of 8 would fall
    back to eager, and fullgraph=True turns that into an error)."""
    import torch._dynamo.config as dynamo_config

    _PlannedGraphs.total += num_graphs
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 4 * _PlannedGraphs.total)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit,
                                                    16 * _PlannedGraphs.total)
