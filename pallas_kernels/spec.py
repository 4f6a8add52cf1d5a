"""What every op declares once, next to its reference: fake, tolerances, input generator.

The spec is what providers are held to. Tests run every provider on ``spec.generate(rng)``
cases and compare with ``spec.reference`` through ``spec.assert_close``; the fake function
gives torch.compile output shapes for providers that are opaque custom calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Tuple

import numpy as np
import torch


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance for one output dtype."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class OpCase:
    """One generated call: positional tensors, keyword arguments, and a short label."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any] = field(default_factory=dict)
    label: str = ""

    def run(self, fn: Callable):
        return fn(*self.args, **self.kwargs)


@dataclass(frozen=True)
class OpSpec:
    """The contract of one op: its one reference and what providers are checked against."""

    name: str
    reference: Callable
    fake: Callable
    tolerances: Mapping[torch.dtype, Tolerance]
    generate: Callable[[np.random.Generator], OpCase]

    def __post_init__(self):
        missing = {torch.float32, torch.bfloat16} - set(self.tolerances)
        if missing:
            raise ValueError(f"op {self.name!r} declares no tolerance for {sorted(map(str, missing))}")

    def assert_close(self, actual: torch.Tensor, expected: torch.Tensor, label: str = "") -> None:
        """Compare in fp32 with the tolerance of the expected output's dtype."""
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            raise AssertionError(f"{self.name} {label}: got {actual.dtype}{list(actual.shape)}, "
                                 f"expected {expected.dtype}{list(expected.shape)}")
        tol = self.tolerances[expected.dtype]
        torch.testing.assert_close(actual.float(), expected.float(), atol=tol.atol, rtol=tol.rtol,
                                   msg=lambda m: f"{self.name} {label}: {m}")
