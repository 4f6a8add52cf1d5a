"""Where the host's time per engine step goes, by phase (pure Python).

The engine and the model runner wrap each piece of their per-step host work in
``timer.phase(name)``; ``tpu-executor bench host`` reads the sums. The default timer records
nothing and costs one attribute lookup per phase, so serving pays nothing for it.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator

# The phases, in the order a step runs them. ``device`` is the model step and the sampler: it
# is the device's time, not the host's (on the native CPU path both are the same cores).
PHASES = ("schedule", "inputs", "transfer", "device", "output", "detokenize")


class NullPhaseTimer:
    """Records nothing (the default)."""

    _NOTHING = contextlib.nullcontext()

    def phase(self, name: str):  # noqa: ARG002 - same signature as PhaseTimer.phase
        return self._NOTHING


class PhaseTimer(NullPhaseTimer):
    """Sums the seconds spent in each phase since the last ``reset``."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = {}
