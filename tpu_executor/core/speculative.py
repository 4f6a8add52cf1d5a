"""Speculative decoding's config (pure Python).

A running sequence may carry up to ``num_speculative_tokens`` draft tokens into a step. The
target model computes the sequence's last token and its drafts in the step (as decode rows on
the bucketed paths, a packed call at exact sizes); each position draws its token as the
sampler would, and the verifier accepts the longest run of drafts equal to the drawn tokens,
then the token drawn after it: a step gives 1 to k + 1 tokens, exactly the tokens decoding one
at a time would have given.
Drafts come from prompt lookup in the engine core (``ngram``: ``engine/drafter.py``), or in the
worker from a smaller model with the same vocabulary (``draft_model``: ``worker/draft_model.py``)
or an EAGLE-3 head over the target's hidden states (``eagle3``: ``worker/eagle3.py``); the
verifier runs in the worker (``worker/verify.py``); the scheduler budgets the drafts' slots and
blocks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Protocol, Tuple, Union

if TYPE_CHECKING:
    from tpu_executor.core.request import Request

METHODS = ("ngram", "draft_model", "eagle3")
# The methods whose drafts come from a checkpoint (``model``), run in the worker.
MODEL_METHODS = ("draft_model", "eagle3")
# vLLM's methods that this engine does not run: named so the error says so.
LATER_METHODS = ("eagle", "medusa", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: the method, the draft tokens per step, the n-gram sizes
    (``ngram``), the draft checkpoint (``draft_model``: a directory, its vocabulary the
    target's; ``eagle3``: an EAGLE-3 head trained for the target), and the running batch above
    which no sequence speculates (``disable_by_batch_size``: verifying drafts costs more than
    the steps it saves once the batch is large enough that one decode step is no longer cheap)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: Optional[int] = None
    model: Optional[str] = None

    def __post_init__(self):
        _check_method(self.method)
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer from 1 to "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {low!r} and {high!r}")
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config method {self.method!r} needs \"model\": the draft checkpoint's "
                             "directory")
        if self.method not in MODEL_METHODS and self.model is not None:
            raise ValueError(f"speculative_config \"model\" is for methods {MODEL_METHODS}, not {self.method!r}")
        limit = self.disable_by_batch_size
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config disable_by_batch_size must be a positive integer, got {limit!r}")

    @classmethod
    def parse(cls, value: Union[None, str, Mapping[str, Any], "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """A config from what a user passes: a mapping (``LLM``), JSON text (the command
        line), a config, or None (no speculation). Unknown keys are an error naming them."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        if "method" not in value:
            raise ValueError("speculative_config needs a method, e.g. {\"method\": \"ngram\"}")
        _check_method(value["method"])  # an unsupported method is the error to report, before its keys
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        return cls(**value)

    def describe(self) -> str:
        """The config as the start-up report prints it."""
        limit = "" if self.disable_by_batch_size is None else f", off above {self.disable_by_batch_size} running"
        source = {"draft_model": f"draft model {self.model}", "eagle3": f"EAGLE-3 head {self.model}"}.get(
            self.method, f"n-grams of {self.prompt_lookup_min}-{self.prompt_lookup_max}")
        return f"{self.method}, {self.num_speculative_tokens} draft tokens, {source}{limit}"


def _check_method(method: object) -> None:
    if method in LATER_METHODS:
        raise ValueError(f"speculative_config method {method!r} is not supported by this engine; use one of {METHODS}")
    if method not in METHODS:
        raise ValueError(f"unknown speculative_config method {method!r}; use one of {METHODS}")


class Drafter(Protocol):
    """What the scheduler asks of a drafter (``engine/drafter.py``). ``drafts_in_worker``: its
    drafts come from the worker after each step, for the requests the step names
    (``SchedulerOutput.drafting``)."""

    drafts_in_worker: bool

    def active(self, num_running: int) -> bool:
        """Whether sequences speculate in a step with ``num_running`` running sequences."""

    def propose(self, request: "Request", max_drafts: int) -> Tuple[int, ...]:
        """Up to ``max_drafts`` draft tokens to follow the request's tokens (none: it decodes)."""


@dataclass
class SpecCounts:
    """Speculation's figures as vLLM reports them: verifies (``num_drafts``), draft tokens
    verified, drafts accepted, and accepted drafts per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: List[int] = field(default_factory=list)

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify of ``num_draft_tokens`` drafts, of which the first ``num_accepted`` held."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        per_position.extend([0] * (num_accepted - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify gave on average (accepted drafts plus the target's own), 0 before any."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
