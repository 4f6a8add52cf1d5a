"""Bucketed shapes and the recompilation guard.

XLA compiles one graph per input shape, so every dynamic size is padded up to a bucket and
every bucket is compiled at start-up. After warm-up the guard reads torch_xla's
``UncachedCompile`` counter and dynamo's graph count: any growth means a shape escaped the
buckets. Strict mode raises; default mode logs once per new compilation.
"""
from __future__ import annotations

import bisect
import contextlib
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
    """Counts the compilations that happen inside this runner's steps after warm-up.

    The counters are process-wide, so the guard only attributes the difference across its own
    calls (another engine in the same process compiling in between does not count).
    """

    def __init__(self, strict: bool):
        self.strict = strict
        self.warmed_up = False
        self.compiled_during_warmup = 0
        self.compiled_after_warmup = 0
        self._warmup_start = (0, 0)

    def begin_warmup(self) -> None:
        self._warmup_start = compile_counts()

    def end_warmup(self) -> None:
        self.compiled_during_warmup = compile_counts()[0] - self._warmup_start[0]
        self.warmed_up = True

    @contextlib.contextmanager
    def watch(self, what: str):
        """Wrap one serving step; raises (strict) or logs if it compiled anything."""
        before = compile_counts()
        yield
        if not self.warmed_up:
            return
        after = compile_counts()
        new = (after[0] - before[0]) + (after[1] - before[1])
        if new == 0:
            return
        self.compiled_after_warmup += new
        message = f"{new} compilation(s) after warm-up in {what}; a shape escaped the buckets"
        if self.strict:
            raise RecompilationError(message)
        logger.warning(message)
