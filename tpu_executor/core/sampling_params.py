"""Sampling parameters of one request (pure Python), shaped like vLLM's ``SamplingParams``."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step`` hands out for a request (vLLM's names). ``DELTA``: a delta on
    every step the request advances (streaming). ``FINAL_ONLY``: one output when it finishes,
    holding everything (``LLM.generate`` asks for it: no per-step output objects or text
    slicing for requests nobody reads until the end)."""

    DELTA = 1
    FINAL_ONLY = 2


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the output tokens of one request.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or -1) disables top-k, ``top_p == 1`` and
    ``min_p == 0`` disable nucleus and min-p filtering. ``seed`` makes sampling reproducible
    for this request whatever else is batched with it. ``n`` parallel samples share the
    prompt's KV blocks. ``logprobs`` asks for the top-N log-probabilities of every output token.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: Union[None, str, Sequence[str]] = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.DELTA

    def __post_init__(self):
        stop = self.stop
        stop = () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))  # None as in vLLM
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be None or a non-negative integer, got {self.seed!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
               f"logprobs must be None or a non-negative integer, got {self.logprobs!r}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
