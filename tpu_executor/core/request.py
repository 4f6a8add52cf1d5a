"""Requests and their outputs (pure Python, shared by every device path)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Optional, Tuple

from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.core.step import ENTRY_ALLOWED, ENTRY_BANNED, ENTRY_BIAS, ENTRY_STOP, LogitsProcessing, SamplingMeta


class RequestStatus(enum.Enum):
    """Where a request is; the finished values double as vLLM's ``finish_reason``."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    def __init__(self, value: str):
        # Plain attributes set once per member, not properties: they are read for every
        # running sequence on every step, and an enum property costs ~20x an attribute read.
        self.is_finished = value not in ("waiting", "running")
        self.finish_reason: Optional[str] = value if self.is_finished else None


# slots: its fields are read for every running sequence on every step; eq=False: a request is
# itself (the scheduler finds it in its queues by identity, not by comparing every field).
@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated: prompt, outputs so far and scheduling state.

    A request with ``n > 1`` samples is several ``Request`` objects (one per sample) that the
    engine groups back into one ``RequestOutput``.
    """

    request_id: str
    prompt_token_ids: List[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_id: Optional[int] = None
    # The bad words as token sequences (the front-end's tokenizer made them).
    bad_words_token_ids: Tuple[Tuple[int, ...], ...] = ()
    output_token_ids: List[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is computed or scheduled
    num_prefill_tokens: int = 0  # tokens the current prefill covers (set on admission)
    last_chunk_start: int = 0  # where the latest prefill chunk began (tokens before it are computed)
    num_preemptions: int = 0
    num_in_flight: int = 0  # tokens scheduled whose ids have not come back yet
    prompt_logprobs_from: int = 1  # the first prompt token whose log-prob is still owed
    draft_misses: int = 0  # verifies in a row that accepted no draft (speculative decoding)
    draft_wait: int = 0  # steps it decodes before it drafts again
    drafts: Tuple[int, ...] = ()  # a draft model's drafts, made when it had ``drafted_at`` tokens
    drafted_at: int = -1
    stop_reason: Optional[object] = None  # the stop token id that finished it (not the EOS)
    error: Optional[str] = None
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with (None: the base model)
    lora_slot: int = 0  # the device slot of its adapter while it runs (0: the base model)
    _token_ids: List[int] = field(default_factory=list, init=False, repr=False)
    sampling: SamplingMeta = field(init=False, repr=False)  # the sampler's view, built once
    # The ids that finish it (EOS unless ignored, and stop_token_ids), settled once: the
    # scheduler checks every recorded token against them.
    stop_token_ids: FrozenSet[int] = field(init=False, repr=False)
    # The outputs it may make: max_tokens, or fewer where the context ends first (the
    # scheduler, which knows max_model_len, lowers it when the request is added).
    max_outputs: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        params = self.sampling_params
        eos = () if params.ignore_eos or self.eos_token_id is None else (self.eos_token_id,)
        self.stop_token_ids = frozenset((*params.stop_token_ids, *eos))
        processing = logits_processing(params, self.stop_token_ids, self.bad_words_token_ids)
        self.sampling = SamplingMeta(params.temperature, params.top_k, params.top_p, params.min_p, self.seed,
                                     len(self.prompt_token_ids), -1 if params.logprobs is None else params.logprobs,
                                     processing)
        self.max_outputs = params.max_tokens

    @property
    def cache_root(self) -> Optional[bytes]:
        """What its prefix-cache hashes chain on: its adapter's id (two adapters never share
        K/V blocks), or None for the base model."""
        return None if self.lora_request is None else f"lora {self.lora_request.lora_int_id}".encode()

    @property
    def all_token_ids(self) -> List[int]:
        """Prompt then outputs (read-only). Outputs are only ever appended, so the list is
        extended with the new ones instead of being rebuilt on every step."""
        tokens = self._token_ids
        missing = len(self.prompt_token_ids) + len(self.output_token_ids) - len(tokens)
        if missing:
            if not tokens:
                tokens.extend(self.prompt_token_ids)
                missing -= len(tokens)
            if missing:
                tokens.extend(self.output_token_ids[-missing:])
        return tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefilling(self) -> bool:
        """Admitted, with chunks of its prefill still to schedule."""
        return self.num_computed_tokens < self.num_prefill_tokens


def logits_processing(params: SamplingParams, stop_token_ids: FrozenSet[int],
                      bad_words_token_ids: Tuple[Tuple[int, ...], ...]) -> Optional[LogitsProcessing]:
    """The sampler's view of a request's logits processing, or None when it has none. A
    one-token bad word is a banned entry; a longer one a (prefix, last token) pair."""
    if not params.processes_logits:
        return None
    entries = [(t, float(v), ENTRY_BIAS) for t, v in params.logit_bias]
    entries += [(t, 0.0, ENTRY_ALLOWED) for t in params.allowed_token_ids or ()]
    if params.min_tokens:
        entries += [(t, 0.0, ENTRY_STOP) for t in sorted(stop_token_ids)]
    entries += [(word[0], 0.0, ENTRY_BANNED) for word in bad_words_token_ids if len(word) == 1]
    longer = [word for word in bad_words_token_ids if len(word) > 1]
    ids, values, kinds = zip(*entries) if entries else ((), (), ())
    return LogitsProcessing(float(params.presence_penalty), float(params.frequency_penalty),
                            float(params.repetition_penalty), tuple(ids), tuple(values), tuple(kinds),
                            params.min_tokens, tuple(w[:-1] for w in longer), tuple(w[-1] for w in longer),
                            params.structured_outputs is not None)


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request: text, token ids, cumulative and per-token log-probs.

    In a step's delta it holds only what is new since the last delta (text, ids, log-probs);
    ``cumulative_logprob`` is always the running total.
    """

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, float]]]
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: "CompletionOutput") -> None:
        """Append a later delta of the same sample."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


@dataclass(slots=True)
class RequestMetrics:
    """When a request arrived, when its first sample was first scheduled and when the engine
    read its first token back (``time.monotonic()`` seconds): the engine's own times, so a
    request that wants only its final output still has them."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None

    @property
    def queue_time(self) -> Optional[float]:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """A request's output (vLLM's shape). ``LLMEngine.step`` returns deltas: ``outputs`` holds
    the samples that advanced in that step, each with only its new text, ids and log-probs;
    ``finished`` is True on the last delta of the request. ``LLM.generate`` returns the deltas
    accumulated with ``add``."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool
    error: Optional[str] = None
    metrics: Optional[RequestMetrics] = None
    # Per prompt token its log-prob and top alternatives (None for the first), once they are all
    # in (with ``SamplingParams.prompt_logprobs``); the delta that first has them carries them.
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
    prompt_logprob_ranks: Optional[List[Optional[int]]] = None  # each prompt token's rank (1: most likely)

    def add(self, delta: "RequestOutput") -> None:
        """Merge a later delta of the same request into this one, sample by sample."""
        by_index = {c.index: c for c in self.outputs}
        for completion in delta.outputs:
            if completion.index in by_index:
                by_index[completion.index].add(completion)
            else:
                copy = CompletionOutput(completion.index, "", [], None, None)
                copy.add(completion)
                self.outputs.append(copy)
                by_index[completion.index] = copy
        self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        self.error = delta.error or self.error
        self.metrics = delta.metrics or self.metrics
        self.prompt_logprobs = delta.prompt_logprobs or self.prompt_logprobs
        self.prompt_logprob_ranks = delta.prompt_logprob_ranks or self.prompt_logprob_ranks


def accumulate_deltas(deltas: Iterable[RequestOutput]) -> Dict[str, RequestOutput]:
    """Each request's deltas, in order, added up into its whole output, by request id."""
    totals: Dict[str, RequestOutput] = {}
    for delta in deltas:
        if delta.request_id not in totals:
            totals[delta.request_id] = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [], False)
        totals[delta.request_id].add(delta)
    return totals
