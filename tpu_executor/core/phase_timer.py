"""Where the host's time per engine step goes, by phase (pure Python).

The engine and the model runner wrap each piece of their per-step work in
``timer.phase(name)``; ``tpu-executor bench host`` and ``bench throughput --profile`` read the
sums. The default timer records nothing and costs one attribute lookup per phase, so serving
pays nothing for it.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Dict, List, Optional

# The phases, in the order a step runs them ("mixed": a prefill pack and the decodes in one
# call, eager devices only). The device phases are the model calls and the
# sampler: the device's time, not the host's (on the native CPU path both are the same cores).
PHASES = ("schedule", "inputs", "transfer", "prefill", "decode", "mixed", "sample", "output", "detokenize")
DEVICE_PHASES = ("prefill", "decode", "mixed", "sample")
HOST_PHASES = tuple(p for p in PHASES if p not in DEVICE_PHASES)


class NullPhaseTimer:
    """Records nothing (the default)."""

    _NOTHING = contextlib.nullcontext()

    def phase(self, name: str):  # noqa: ARG002 - same signature as PhaseTimer.phase
        return self._NOTHING


class PhaseTimer(NullPhaseTimer):
    """Sums the seconds spent in each phase, and counts its calls, since the last ``reset``.

    ``synchronize``, when given, runs at the end of every device phase before the clock
    stops: on a device that runs asynchronously (XLA) a call only dispatches, and without it
    the device's time would land in whatever phase waits next. ``active`` names the phases
    the calling thread has open, innermost last (the engine and an asynchronous model
    runner time their phases on two threads).
    """

    def __init__(self, synchronize: Optional[Callable[[], None]] = None):
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self._synchronize = synchronize
        self._local = threading.local()

    @property
    def active(self) -> List[str]:
        try:
            return self._local.active
        except AttributeError:
            self._local.active = []
            return self._local.active

    def phase(self, name: str) -> "_Phase":
        return _Phase(self, name)

    def _close(self, name: str, start: float, failed: bool) -> None:
        """End the calling thread's innermost phase, ``name``, begun at ``start``."""
        try:
            if not failed and self._synchronize is not None and name in DEVICE_PHASES:
                self._synchronize()
        finally:
            self.active.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def reset(self) -> None:
        self.seconds = {}
        self.calls = {}


class _Phase:
    """One timed phase (a class, not a generator context manager: it is entered about a dozen
    times per step, and the generator's overhead would land in the figures it measures)."""

    __slots__ = ("_timer", "_name", "_start")

    def __init__(self, timer: PhaseTimer, name: str):
        self._timer = timer
        self._name = name
        self._start = 0.0

    def __enter__(self) -> None:
        self._timer.active.append(self._name)
        self._start = time.perf_counter()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._timer._close(self._name, self._start, exc_type is not None)
