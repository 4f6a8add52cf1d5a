"""Bucketed shapes and the recompilation guard.

XLA compiles one graph per input shape, so every dynamic size is padded up to a bucket and
every bucket is compiled at start-up. After warm-up the guard reads torch_xla's
``UncachedCompile`` counter and dynamo's graph count: any growth means a shape escaped the
buckets. Strict mode raises; default mode logs once per new compilation.
"""
from __future__ import annotations

import bisect
import logging
from typing import Sequence, Tuple

logger = logging.getLogger(__name__)


class RecompilationError(RuntimeError):
    """A graph was compiled after warm-up (strict mode)."""


def effective_buckets(buckets: Sequence[int], limit: int, multiple: int = 1) -> Tuple[int, ...]:
    """The buckets below ``limit`` plus ``limit`` rounded up to ``multiple`` as the last one."""
    top = -(-limit // multiple) * multiple
    return tuple(sorted({b for b in buckets if b < top} | {top}))


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket that holds ``size``."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def compile_counts() -> Tuple[int, int]:
    """(XLA compilations, dynamo graphs) so far in this process."""
    import torch._dynamo.utils
    import torch_xla.debug.metrics as met

    xla = met.counter_value("UncachedCompile") or 0
    dynamo = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return int(xla), int(dynamo)


class CompileGuard:
    """Counts compilations since warm-up finished and enforces the zero-recompilation rule."""

    def __init__(self, strict: bool):
        self.strict = strict
        self._baseline = None
        self.compiled_during_warmup = 0
        self._start = None

    def begin_warmup(self) -> None:
        self._start = compile_counts()

    def end_warmup(self) -> None:
        self._baseline = compile_counts()
        self.compiled_during_warmup = self._baseline[0] - self._start[0]

    def new_compilations(self) -> int:
        """XLA compilations plus dynamo graphs since warm-up (0 when all is well)."""
        if self._baseline is None:
            return 0
        now = compile_counts()
        return (now[0] - self._baseline[0]) + (now[1] - self._baseline[1])

    def check(self, what: str) -> None:
        """Call after each compiled step; raises in strict mode if it compiled."""
        new = self.new_compilations()
        if new == 0:
            return
        message = f"{new} compilation(s) after warm-up (last step: {what}); a shape escaped the buckets"
        if self.strict:
            raise RecompilationError(message)
        logger.warning(message)
        self._baseline = compile_counts()
