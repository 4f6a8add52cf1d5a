"""The recompilation guard.

XLA compiles one graph per input shape, so every dynamic size is padded up to a bucket of the
plan (``core/buckets.py``) and every graph of the plan is compiled at start-up. After warm-up
the guard reads torch_xla's ``UncachedCompile`` counter and dynamo's graph count: any growth
means a shape escaped the buckets. Strict mode raises; default mode logs each time.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Tuple

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


class CompileGuard:
    """Counts the compilations that happen inside this runner's steps after warm-up.

    The counters are process-wide, so the guard only attributes the difference across its own
    calls (another engine in the same process compiling in between does not count).
    """

    def __init__(self, strict: bool, enabled: bool = True):
        self.strict = strict
        self.enabled = enabled  # False on the native path: nothing compiles, torch_xla stays unloaded
        self.warmed_up = False
        self.compiled_during_warmup = 0
        self.compiled_after_warmup = 0
        self._warmup_start = (0, 0)

    def begin_warmup(self) -> None:
        if self.enabled:
            self._warmup_start = compile_counts()

    def end_warmup(self) -> None:
        if self.enabled:
            self.compiled_during_warmup = compile_counts()[0] - self._warmup_start[0]
        self.warmed_up = True

    @contextlib.contextmanager
    def watch(self, what: str):
        """Wrap one serving step; raises (strict) or logs if it compiled anything."""
        if not self.enabled:
            yield
            return
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
