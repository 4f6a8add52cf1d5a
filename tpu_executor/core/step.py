"""The wire types of one engine step (pure Python): what the scheduler hands the workers and
what a worker hands back. Executors carry them unchanged to every worker (over Ray too), so
they are immutable records of ints, floats and tuples. The per-sequence ones (made for every
running sequence on every step) are NamedTuples: a frozen dataclass costs several times more
to build, which at hundreds of sequences is a visible share of the host's time per step.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

# Kinds of a logits entry (``LogitsProcessing.entry_kinds``).
ENTRY_BIAS = 0  # add the value to the token's logit
ENTRY_ALLOWED = 1  # a row with any of these samples only among them
ENTRY_STOP = 2  # banned while fewer than min_tokens outputs exist (EOS, stop token ids)
ENTRY_BANNED = 3  # banned always (a one-token bad word)


class LogitsProcessing(NamedTuple):
    """What the sampler does to one request's logits before it picks (built once per request;
    see ``SamplingParams``): penalties, token entries (``ENTRY_*``), ``min_tokens``, the
    bad words of several tokens as (all but the last token, the last token), and whether a
    grammar constrains it (its token mask comes with each step: ``SchedulerOutput``)."""

    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    entry_ids: Tuple[int, ...]
    entry_values: Tuple[float, ...]
    entry_kinds: Tuple[int, ...]
    min_tokens: int
    bad_word_prefixes: Tuple[Tuple[int, ...], ...]
    bad_word_last: Tuple[int, ...]
    constrained: bool = False


class SamplingMeta(NamedTuple):
    """What the device sampler needs for one row, fixed for the request's life (built once, so
    a step makes no new one per sequence). A row's seeding step is the index of the token it
    samples among the outputs: ``sampled_position - prompt_len``. ``num_logprobs`` is -1 when
    the request wants no log-probs."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    prompt_len: int
    num_logprobs: int
    processing: Optional[LogitsProcessing] = None  # None: the logits are sampled as they are

    @classmethod
    def greedy(cls) -> "SamplingMeta":
        """A greedy row that wants no log-probs (padding rows, warm-up, profiling)."""
        return cls(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, prompt_len=0, num_logprobs=-1)


class PrefillWork(NamedTuple):
    """Compute ``token_ids`` at positions ``start_pos...`` (earlier ones are prefix-cached or
    computed by earlier chunks). Only a chunk that ends the prompt (``is_last_chunk``) is
    sampled; an earlier chunk returns no token."""

    request_id: str
    token_ids: Tuple[int, ...]
    start_pos: int
    block_ids: Tuple[int, ...]
    sampling: SamplingMeta
    is_last_chunk: bool = True
    # The last chunk of a request whose logits are processed carries its tokens so far (prompt,
    # then outputs; ``sampling.prompt_len`` splits them): the worker's state for it starts there.
    history: Optional[Tuple[int, ...]] = None
    # A request owed prompt log-probs: per token of the chunk, the prompt token after it whose
    # log-prob that position gives (-1: none owed there).
    prompt_logprob_targets: Optional[Tuple[int, ...]] = None
    # A chunk that does not end its prompt: the prompt token after it (an EAGLE head's input at
    # the chunk's last position).
    next_token_id: Optional[int] = None
    # The device slot of the request's LoRA adapter (0: the base model).
    lora_slot: int = 0

    @property
    def num_context_tokens(self) -> int:
        """Cached plus new tokens: the keys this prompt attends over."""
        return self.start_pos + len(self.token_ids)

    # The token after the last key: the position this work samples.
    sampled_position = num_context_tokens


# A decode's input token that the previous step is still sampling (asynchronous scheduling):
# the worker takes it from that step's output for the same request.
PENDING_TOKEN = -1


class DecodeWork(NamedTuple):
    """Compute one token (the last sampled, or ``PENDING_TOKEN``) at ``position``."""

    request_id: str
    token_id: int
    position: int
    block_ids: Tuple[int, ...]
    sampling: SamplingMeta
    lora_slot: int = 0  # the device slot of the request's LoRA adapter (0: the base model)

    @property
    def sampled_position(self) -> int:
        """The position of the token this work samples."""
        return self.position + 1


@dataclass(frozen=True)
class SchedulerOutput:
    """The work of one engine step (sent to every worker). ``token_bitmasks``: per sampled
    request that a grammar constrains, the tokens it may sample now (xgrammar's bitmask: bit
    ``t % 32`` of int32 word ``t // 32`` set when token ``t`` is allowed; a numpy array)."""

    prefills: Tuple[PrefillWork, ...] = ()
    decodes: Tuple[DecodeWork, ...] = ()
    token_bitmasks: Mapping[str, Any] = field(default_factory=dict)
    # Speculative decoding: per request, its last token then its draft tokens, computed from the
    # last token's position; the worker gives back the accepted drafts and the target's next
    # token (several rows of one request, in order).
    verifies: Tuple[PrefillWork, ...] = ()
    # The requests that may verify drafts in the next step (a draft model drafts for those only).
    drafting: Tuple[str, ...] = ()
    # Multi-LoRA: (slot, LoRARequest) the workers write before the step runs (adapters given a
    # device slot since the step before), in order; (slot, None) empties the slot.
    lora_loads: Tuple[Tuple[int, Any], ...] = ()
    # LoRARequests the workers start reading from disk in the background (the requests that
    # need them run from a later step, whose ``lora_loads`` write them).
    lora_reads: Tuple[Any, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.verifies

    @property
    def request_ids(self) -> List[str]:
        """Every request with work in the step."""
        return ([w.request_id for w in self.prefills] + [w.request_id for w in self.decodes]
                + [w.request_id for w in self.verifies])

    @property
    def sampled_request_ids(self) -> List[str]:
        """The requests the step samples a token for (all but prompts' earlier chunks)."""
        return ([w.request_id for w in self.prefills if w.is_last_chunk] + [w.request_id for w in self.decodes]
                + [w.request_id for w in self.verifies])


@dataclass(frozen=True)
class SampledTokens:
    """The tokens a step sampled, as columns (one list per field, not one record per row:
    hundreds of rows per step). Row ``i`` is request ``request_ids[i]``'s token and its
    log-prob; ``top_logprobs[i]`` its top-N alternatives, None for a request that asked for no
    log-probs (the whole column is None when no request asked)."""

    request_ids: List[str] = field(default_factory=list)
    token_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    top_logprobs: Optional[List[Optional[Dict[int, float]]]] = None

    def __len__(self) -> int:
        return len(self.request_ids)

    def rows(self, indices: Sequence[int]) -> "SampledTokens":
        """Only the given rows, in that order."""
        top = self.top_logprobs
        return SampledTokens([self.request_ids[i] for i in indices], [self.token_ids[i] for i in indices],
                             [self.logprobs[i] for i in indices], None if top is None else [top[i] for i in indices])

    @staticmethod
    def concat(parts: Sequence["SampledTokens"]) -> "SampledTokens":
        """The rows of every part, in order (no part: no rows)."""
        if len(parts) == 1:
            return parts[0]
        top = None
        if any(part.top_logprobs is not None for part in parts):
            top = [t for part in parts for t in (part.top_logprobs or [None] * len(part))]
        return SampledTokens([r for part in parts for r in part.request_ids],
                             [t for part in parts for t in part.token_ids],
                             [lp for part in parts for lp in part.logprobs], top)


class PromptLogprobs(NamedTuple):
    """Log-probs of some of a request's prompt tokens: ``positions`` (their indices in the
    prompt), each token's log-prob given the tokens before it, its rank among the vocabulary
    (1: the most likely), and the top-N alternatives."""

    request_id: str
    positions: Tuple[int, ...]
    logprobs: Tuple[float, ...]
    ranks: Tuple[int, ...]
    top: Tuple[Dict[int, float], ...]


class LoRAFailure(NamedTuple):
    """An adapter a worker could not write into its slot for a step (unreadable, malformed,
    non-finite): the slot is left empty, and the requests of that adapter in that slot fail with
    ``message`` (it names the adapter, never its path on the server)."""

    slot: int
    lora_int_id: int
    message: str


@dataclass(frozen=True)
class ModelRunnerOutput:
    """A worker's answer to one step: a token per sampled request, and the prompt log-probs its
    prefills gave; or the error that failed the step (the worker caught it; its requests fail,
    the engine goes on). ``lora_failures``: the adapters of the step's ``lora_loads`` that could
    not be written (the step ran; their requests' tokens of it must be discarded)."""

    sampled: SampledTokens = field(default_factory=SampledTokens)
    error: Optional[str] = None
    prompt_logprobs: Tuple[PromptLogprobs, ...] = ()
    # Speculative decoding with a draft model: per request, the drafts that follow its tokens
    # once this step's are recorded (the next step verifies them).
    drafts: Mapping[str, Tuple[int, ...]] = field(default_factory=dict)
    lora_failures: Tuple[LoRAFailure, ...] = ()
    # The drafter's error when it failed after the step ran: the step's tokens stand, no drafts.
    draft_error: Optional[str] = None


@dataclass
class PaddingStats:
    """Real versus padded work, to judge the buckets.

    Prefill: tokens of packed calls. Decode rows: sequences versus the batch bucket. Decode
    context: block-table entries the real rows need versus the context bucket's width.
    """

    prefill_tokens_real: int = 0
    prefill_tokens_padded: int = 0
    decode_rows_real: int = 0
    decode_rows_padded: int = 0
    decode_context_blocks_real: int = 0
    decode_context_blocks_padded: int = 0

    def waste(self) -> Dict[str, float]:
        """The padded fraction of each dimension (0 when nothing ran)."""
        def fraction(real: int, padded: int) -> float:
            return 1.0 - real / padded if padded else 0.0
        return {"prefill_tokens": fraction(self.prefill_tokens_real, self.prefill_tokens_padded),
                "decode_rows": fraction(self.decode_rows_real, self.decode_rows_padded),
                "decode_context": fraction(self.decode_context_blocks_real, self.decode_context_blocks_padded)}


@dataclass(frozen=True)
class WorkerStats:
    """One worker's figures: graphs compiled at warm-up and after it, padding, cache size, and
    at warm-up the persistent compile cache's hits and misses and the seconds spent compiling
    or loading (the JAX path; 0 elsewhere); the provider each kernel op got at warm-up."""

    graphs_compiled_at_warmup: int = 0
    graphs_compiled_after_warmup: int = 0
    padding: PaddingStats = field(default_factory=PaddingStats)
    kv_cache_bytes: int = 0
    compile_cache_hits: int = 0
    compile_cache_misses: int = 0
    compile_seconds: float = 0.0
    kernel_providers: Tuple[Tuple[str, str], ...] = ()  # (op, provider) the model's calls took at warm-up

    @staticmethod
    def combine(ranks: Sequence["WorkerStats"]) -> "WorkerStats":
        """The group's figures: the worst rank's compilations and compile-cache misses, rank 0's
        padding and cache (every rank runs the same shapes over its own slice of the heads)."""
        return dataclasses.replace(ranks[0], graphs_compiled_at_warmup=max(s.graphs_compiled_at_warmup for s in ranks),
                                   graphs_compiled_after_warmup=max(s.graphs_compiled_after_warmup for s in ranks),
                                   compile_cache_misses=max(s.compile_cache_misses for s in ranks))


def completed_future(call: Callable[[], Any]) -> Future:
    """A future already holding ``call()``'s result, or the exception it raised."""
    future: Future = Future()
    try:
        future.set_result(call())
    except BaseException as err:  # noqa: BLE001 - handed to whoever reads the future
        future.set_exception(err)
    return future
