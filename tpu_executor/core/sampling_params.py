"""Sampling parameters of one request (pure Python), shaped like vLLM's ``SamplingParams``."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

# What one request may ask of the logits processing (the device holds these many per row).
MAX_LOGIT_BIAS = 300
MAX_LOGIT_ENTRIES = 1024  # logit_bias + allowed_token_ids + stop ids + one-token bad words
MAX_BAD_WORDS = 16  # bad words of several tokens
MAX_BAD_WORD_TOKENS = 8
# Bounds on what enters the engine, so no request can overflow the device's rows or slow every
# step: ids and top_k fit the rows' int32 slots (a top_k at or above the vocabulary keeps every
# token, as vLLM), a temperature stays finite after the float32 division, stop strings are
# matched against every new piece of text.
MAX_INT32 = 2**31 - 1
MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024


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
class StructuredOutputsParams:
    """A grammar the output must follow (vLLM's ``StructuredOutputsParams``); exactly one of:
    ``json`` (a JSON Schema, as a dict or its text), ``regex``, ``choice`` (one of these
    strings), ``grammar`` (EBNF, as xgrammar reads it), ``json_object`` (any JSON object).
    ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens)."""

    json: Union[None, str, Mapping[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if self.json is not None and not isinstance(self.json, str):  # hashable, one text per schema
            try:
                object.__setattr__(self, "json", json.dumps(self.json, sort_keys=True))
            except (TypeError, ValueError) as err:
                raise ValueError(f"structured_outputs.json is not JSON: {err}") from None
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        _check(len(kinds) == 1, "structured_outputs must set exactly one of json, regex, choice, grammar, "
                                f"json_object; got {kinds or 'none'}")
        _check(self.choice is None or (len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice)),
               f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value.strip() != ""),
                   f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    @property
    def kind(self) -> str:
        """Which grammar this is: json, regex, choice, grammar or json_object."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, name))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the output tokens of one request.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or -1) disables top-k, ``top_p == 1`` and
    ``min_p == 0`` disable nucleus and min-p filtering. ``seed`` makes sampling reproducible
    for this request whatever else is batched with it. ``n`` parallel samples share the
    prompt's KV blocks. ``logprobs`` asks for the top-N log-probabilities of every output token,
    ``prompt_logprobs`` for those of every prompt token after the first (given the tokens before
    it; such a prompt is computed whole, never taken from the prefix cache).

    Logits processing, as vLLM's: ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2])
    subtract from the logit of every token already in the output, once or per occurrence;
    ``repetition_penalty`` (> 0) divides positive and multiplies negative logits of tokens in
    the prompt or the output; ``logit_bias`` adds to given tokens' logits (at most 300, each in
    [-100, 100]); ``min_tokens`` keeps EOS and the stop token ids out until that many tokens
    are out (stop strings wait as well); ``allowed_token_ids`` restricts the choice to those
    ids; ``bad_words`` are never completed (a word's last token is banned whenever the output
    ends with the rest of it). ``structured_outputs`` restricts every token to those its grammar
    allows next (``StructuredOutputsParams``).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Union[None, Mapping[int, float], Tuple[Tuple[int, float], ...]] = None
    min_tokens: int = 0
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    prompt_logprobs: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        stop = self.stop
        stop = () if stop is None else ((stop,) if isinstance(stop, str) else tuple(stop))
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))  # None as in vLLM
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        # Hashable forms: (token id, bias) pairs by id, the allowed ids sorted, the words in order.
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple(sorted((k, v) for k, v in bias)))
        allowed = self.allowed_token_ids
        object.__setattr__(self, "allowed_token_ids", None if allowed is None else tuple(sorted(set(allowed))))
        object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        self._validate()
        self._validate_processing()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
               f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and 0 <= self.top_k <= MAX_INT32,
               f"top_k must be -1, 0 (disabled) or a positive integer up to {MAX_INT32}, got {self.top_k!r}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be None or a non-negative integer, got {self.seed!r}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               f"stop must be non-empty strings, got {self.stop!r}"[:300])
        _check(len(self.stop) <= MAX_STOP_STRINGS and all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
               f"stop holds {len(self.stop)} strings of up to {max(map(len, self.stop), default=0)} characters; "
               f"at most {MAX_STOP_STRINGS} of at most {MAX_STOP_STRING_CHARS} characters are allowed")
        _check(all(isinstance(t, int) and 0 <= t <= MAX_INT32 for t in self.stop_token_ids),
               f"stop_token_ids must be token ids (non-negative integers), got {self.stop_token_ids!r}"[:300])
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
               f"logprobs must be None or a non-negative integer, got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
               f"prompt_logprobs must be None or a non-negative integer, got {self.prompt_logprobs!r}")
        _check(isinstance(self.output_kind, RequestOutputKind),
               f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
               f"structured_outputs must be a StructuredOutputsParams, got {type(self.structured_outputs).__name__}")

    def _validate_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and -2.0 <= value <= 2.0,
                   f"{name} must be in [-2, 2], got {value!r}")
        _check(isinstance(self.repetition_penalty, (int, float)) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0,
               f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        _check(len(self.logit_bias) <= MAX_LOGIT_BIAS,
               f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        _check(all(isinstance(k, int) and k >= 0 for k, _ in self.logit_bias),
               f"logit_bias keys must be token ids (non-negative integers), got {[k for k, _ in self.logit_bias][:8]}")
        _check(all(isinstance(v, (int, float)) and -100.0 <= v <= 100.0 for _, v in self.logit_bias),
               f"logit_bias values must be in [-100, 100], got {[v for _, v in self.logit_bias][:8]}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        allowed = self.allowed_token_ids
        _check(allowed is None or (len(allowed) > 0 and all(isinstance(t, int) and t >= 0 for t in allowed)),
               f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}")
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
               f"bad_words must be non-empty strings, got {self.bad_words!r}")
        entries = len(self.logit_bias) + len(allowed or ()) + len(self.stop_token_ids) + len(self.bad_words)
        _check(entries <= MAX_LOGIT_ENTRIES - 1,  # one left for the EOS
               f"logit_bias with allowed_token_ids, stop_token_ids and bad_words makes {entries} token entries; "
               f"at most {MAX_LOGIT_ENTRIES - 1} are allowed")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it samples."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.allowed_token_ids is not None or self.bad_words
                    or self.structured_outputs is not None)
