"""The engine's front-end: validates requests, runs the core's steps (``engine/core.py``),
turns their token ids into text, applies stop strings, and hands out what each step produced
as deltas.

The core schedules and runs the model on token ids; everything a user reads (text, log-probs,
finish reasons) is built here, from what the core reports. A stop string found in the text
ends the sample here and in the core at once. One bad request never takes the engine down:
invalid input is rejected in ``add_request`` before anything is queued, and an error while a
step runs fails only the requests of that step. A lost worker ends the engine
(``EngineDeadError``, carrying the last deltas of every request it failed).
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.detokenizer import Detokenizer, DetokenizerState, take_text_delta, truncate_at_stop
from tpu_executor.core.heap import freeze_startup_heap, unfreeze_heap
from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.core.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus
from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams
from tpu_executor.core.step import PromptLogprobs, SampledTokens
from tpu_executor.engine.core import CoreOutput, EngineCore, EngineDeadError, Finished
from tpu_executor.engine.core_process import start_core
from tpu_executor.engine.options import build_engine_config
from tpu_executor.engine.protocols import CoreClient
from tpu_executor.engine.stats import EngineStats
from tpu_executor.engine.validation import RequestChecks
from tpu_executor.executor import Executor, WorkerMaker
from tpu_executor.worker.inputs import check_sampling_row

__all__ = ["EngineDeadError", "LLMEngine", "PromptType"]

PromptType = Union[str, Dict[str, List[int]]]
_STOP = RequestStatus.FINISHED_STOPPED.finish_reason
_ABORT = RequestStatus.FINISHED_ABORTED.finish_reason
_ERROR = RequestStatus.FINISHED_ERROR.finish_reason


@dataclass(slots=True)
class SampleStream:
    """What one sample has produced, as the front-end knows it from the core's reports, and
    how much of it has gone out in deltas."""

    sample_id: str
    detok: DetokenizerState
    group_id: str
    index: int  # among the group's samples
    final_only: bool  # the request wants one output when it finishes (RequestOutputKind.FINAL_ONLY)
    min_tokens: int  # stop strings count only from this many tokens on
    token_ids: List[int] = field(default_factory=list)
    logprobs: Optional[List[Dict[int, float]]] = None  # None: the request asked for none
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[object] = None
    error: Optional[str] = None
    sent_tokens: int = 0
    advanced: bool = False  # has news for the next delta


@dataclass
class PromptLogprobsState:
    """A request's prompt log-probs as they come in (its first sample's), and whether they
    have gone out; ``values[0]`` stays None (the first token has no log-prob)."""

    width: int  # the top alternatives wanted per token
    values: List[Optional[Dict[int, float]]]
    ranks: List[Optional[int]]
    missing: int
    sent: bool = False


@dataclass
class RequestGroup:
    """The ``n`` samples of one user request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    samples: List[SampleStream]
    metrics: RequestMetrics
    prompt_logprobs: Optional[PromptLogprobsState] = None

    @property
    def finished(self) -> bool:
        return all(sample.finish_reason is not None for sample in self.samples)

    @property
    def error(self) -> Optional[str]:
        return next((sample.error for sample in self.samples if sample.error), None)


class LLMEngine:
    """Continuous-batching generation engine over one executor.

    ``executor`` defaults to the one the config asks for (in-process, or Ray actors for
    tensor parallelism); the engine's core owns it and shuts it down. ``core`` replaces the
    core itself (``start_core``'s choice by default): any ``CoreClient``, since the front-end
    knows requests only from what the core reports.
    """

    def __init__(self, config: EngineConfig, tokenizer, executor: Optional[Executor] = None,
                 show_progress: bool = True, core: Optional[CoreClient] = None):
        self.tokenizer = tokenizer
        self.core: CoreClient = core if core is not None else start_core(config, executor, show_progress=show_progress)
        # The core's config: a default max_model_len is lowered there to what the KV cache holds.
        self.config: EngineConfig = self.core.config
        self.vocab_size = self.core.vocab_size
        self.dead_reason: Optional[str] = None
        self.detokenizer = Detokenizer(tokenizer)
        self.checks = RequestChecks(self.config, tokenizer, self.vocab_size)
        self._grammars_in_core = False  # the core has the grammar compiler (sent on first use)
        self._groups: Dict[str, RequestGroup] = {}
        self._streams: Dict[str, SampleStream] = {}  # sample id -> its stream
        self._advanced: Dict[str, RequestGroup] = {}  # groups with samples that have news, by id
        self._seed_rng = random.Random(config.model.seed)
        self._counter = itertools.count()
        self.timer = NullPhaseTimer()  # see attach_phase_timer
        # Ready to serve: later collections skip what start-up built (see core/heap.py).
        freeze_startup_heap()

    @classmethod
    def from_options(cls, model: str, show_progress: bool = True, worker_class: Optional[WorkerMaker] = None,
                     **options) -> "LLMEngine":
        """An engine for the checkpoint at ``model`` from flat engine options (see
        ``engine/options.py``). ``worker_class`` swaps in a ``Worker`` subclass (tests inject
        faults with it)."""
        from transformers import AutoTokenizer

        config = build_engine_config(model, **options)
        core = start_core(config, worker_class=worker_class, show_progress=show_progress)
        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except BaseException:
            core.shutdown()
            raise
        return cls(config, tokenizer, core=core)

    def attach_phase_timer(self, timer):
        """Time the front-end's, the core's and the model runner's phases with ``timer``
        (``bench host``, ``bench throughput --profile``); returns the in-process model runner,
        so a profiler can observe its model too. Needs the core and its worker in this process."""
        if not isinstance(self.core, EngineCore):
            raise ValueError("phase timing needs the engine core in this process (core_process off)")
        self.timer = timer
        return self.core.attach_phase_timer(timer)

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """The prompt's token ids, validated against the model and the engine's limits."""
        token_ids = self.checks.prompt_token_ids(prompt)
        self.checks.validate(token_ids, params)
        return token_ids

    def validate_prompt(self, token_ids: List[int], params: SamplingParams) -> None:
        """Raise ValueError if ``token_ids`` cannot run on this engine with ``params``. Reads
        only fixed facts, so other threads may call it while the engine steps."""
        self.checks.validate(token_ids, params)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    prompt_token_ids: Optional[List[int]] = None, arrival_time: Optional[float] = None,
                    lora_request: Optional[LoRARequest] = None) -> str:
        """Validate and queue a request; returns its id. Invalid input raises ValueError.

        ``prompt_token_ids`` skips tokenising and validating again (from ``prepare_prompt``);
        ``arrival_time`` (``time.monotonic()``) is when it reached the server, default now;
        ``lora_request`` the LoRA adapter it runs with (None: the base model).
        """
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has shut down: {self.dead_reason}")
        request_id = request_id if request_id is not None else str(next(self._counter))
        token_ids = list(prompt_token_ids if prompt_token_ids is not None else self.prepare_prompt(prompt, params))
        self.checks.lora(lora_request)
        samples = [self._new_sample(request_id, token_ids, params, index, lora_request) for index in range(params.n)]
        # A core in another process may still be finishing an ended request of the same id.
        if request_id in self._groups or any(self.core.has_sample(s.sample_id) for s, _ in samples):
            raise ValueError(f"request_id {request_id!r} is already in use")
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                             [stream for stream, _ in samples],
                             RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()))
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = PromptLogprobsState(params.prompt_logprobs, [None] * len(token_ids),
                                                        [None] * len(token_ids), len(token_ids) - 1)
        self._groups[request_id] = group
        if params.structured_outputs is not None and not self._grammars_in_core:
            self.core.use_grammars(self.checks.grammar_compiler)
            self._grammars_in_core = True
        for stream in group.samples:
            self._streams[stream.sample_id] = stream
        self.core.add([request for _, request in samples])
        return request_id

    def _new_sample(self, request_id: str, token_ids: List[int], params: SamplingParams, index: int,
                    lora_request: Optional[LoRARequest] = None) -> "tuple[SampleStream, Request]":
        """A sample's stream (the front-end's) and its request (the core's)."""
        seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(62)
        sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
        request = Request(sample_id, list(token_ids), params, seed, eos_token_id=self.tokenizer.eos_token_id,
                          bad_words_token_ids=self.checks.bad_words_token_ids(params), lora_request=lora_request)
        check_sampling_row(request.sampling)
        stream = SampleStream(sample_id, self.detokenizer.new_state(token_ids, params), request_id, index,
                              params.output_kind is RequestOutputKind.FINAL_ONLY, params.min_tokens,
                              logprobs=None if params.logprobs is None else [])
        return stream, request

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return to the pool at once, and the next
        ``step()`` hands out its last delta (finish reason ``abort``)."""
        group = self._groups.get(request_id)
        aborted = [sample for sample in group.samples if sample.finish_reason is None] if group else []
        for sample in aborted:
            sample.finish_reason = _ABORT
            self._mark_advanced(sample)
        self.core.finish([sample.sample_id for sample in aborted], RequestStatus.FINISHED_ABORTED)

    def forget_lora(self, lora_int_id: int) -> None:
        """Unload adapter ``lora_int_id``: no longer taken as checked, and its device slot is
        emptied in every worker once no running request uses it (a later request for the id
        reads it from disk again)."""
        self.checks.forget_lora(lora_int_id)
        self.core.forget_lora(lora_int_id)

    def abort_all_requests(self) -> None:
        """Abort every request in the engine (shutdown)."""
        for request_id in list(self._groups):
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still runs, waits, or has a delta not yet handed out."""
        return self.core.has_unfinished() or bool(self._advanced)

    @property
    def num_waiting(self) -> int:
        """Samples queued but not running yet."""
        return self.core.num_waiting

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """One step of the core; returns a delta per request that advanced.

        With asynchronous scheduling the core starts the step it just scheduled and reports
        the previous one's tokens, so each call returns the previous step's deltas.
        """
        try:
            output = self.core.step()
        except EngineDeadError as err:
            self._die(err)
        with self.timer.phase("detokenize"):
            self._note_times(output)
            self._add_prompt_logprobs(output.prompt_logprobs)
            stopped = self._add_tokens(output.tokens, output.finished)
            if stopped:  # in the core too, before it schedules them again
                self.core.finish(stopped, RequestStatus.FINISHED_STOPPED)
            self._apply_finished(output.finished)
        with self.timer.phase("output"):
            return self._take_deltas()

    def _note_times(self, output: CoreOutput) -> None:
        """A request's first scheduling and first token: the first report of either counts
        (a few prefills per step, so no pass over the running requests)."""
        for sample_id, at in output.scheduled_at:
            metrics = self._group_metrics(sample_id)
            if metrics is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = at
        for sample_id, at in output.first_token_at:
            metrics = self._group_metrics(sample_id)
            if metrics is not None and metrics.first_token_time is None:
                metrics.first_token_time = at

    def _group_metrics(self, sample_id: str) -> Optional[RequestMetrics]:
        """The metrics of the sample's request (None once the request is forgotten)."""
        sample = self._streams.get(sample_id)
        return None if sample is None else self._groups[sample.group_id].metrics

    def _add_prompt_logprobs(self, reports: Sequence[PromptLogprobs]) -> None:
        """Each prompt token's log-prob and its top alternatives, from a request's first sample."""
        for report in reports:
            sample = self._streams.get(report.request_id)
            state = self._groups[sample.group_id].prompt_logprobs if sample is not None else None
            if state is None or sample.index != 0:
                continue
            prompt = self._groups[sample.group_id].prompt_token_ids
            for position, logprob, rank, top in zip(report.positions, report.logprobs, report.ranks, report.top):
                state.missing -= state.values[position] is None
                state.values[position] = {prompt[position]: logprob, **dict(list(top.items())[:state.width])}
                state.ranks[position] = rank

    def _add_tokens(self, tokens: SampledTokens, finished: Dict[str, Finished]) -> List[str]:
        """Add each sample's new token, its log-probs and its text, and look for its stop
        strings; returns the samples a stop string ended. This loop runs for every running
        sequence on every step: ``_mark_advanced`` is inlined."""
        streams, groups, advanced = self._streams, self._groups, self._advanced
        add_token = self.detokenizer.add_token
        stopped = []
        tops = tokens.top_logprobs if tokens.top_logprobs is not None else itertools.repeat(None)
        ids = tokens.request_ids
        for row, (sample_id, token_id, logprob, top) in enumerate(zip(ids, tokens.token_ids, tokens.logprobs, tops)):
            sample = streams.get(sample_id)
            if sample is None or sample.finish_reason is not None:
                continue  # ended here (abort, a stop string) while its token was on the way
            sample.token_ids.append(token_id)
            if sample.logprobs is not None:
                sample.cumulative_logprob += logprob
                sample.logprobs.append({token_id: logprob, **(top or {})})
            new_text = add_token(sample.detok, token_id)
            ended = finished.get(sample_id)
            if ended is not None and row + 1 < len(ids) and ids[row + 1] == sample_id:
                ended = None  # a verify's rows are consecutive: only the last one's token ended it
            if new_text and sample.detok.stops and self._stop_string_ends(sample, new_text, ended):
                stopped.append(sample_id)
            elif sample.final_only:
                continue  # nothing goes out before the end
            sample.advanced = True
            advanced[sample.group_id] = groups[sample.group_id]
        return stopped

    @staticmethod
    def _stop_string_ends(sample: SampleStream, new_text: str, ended: Optional[Finished]) -> bool:
        """Whether ``new_text`` completes a stop string of the sample (which ends it, cut
        there). A stop token is checked first, as the text of a token that ends the sample on
        its own is never searched; a length limit reached by the same token gives way."""
        if ended is not None and ended.finish_reason == _STOP:
            return False
        stop = truncate_at_stop(sample.detok, new_text, search=len(sample.token_ids) >= sample.min_tokens)
        if stop is None:
            return False
        sample.finish_reason, sample.stop_reason = _STOP, stop
        return True

    def _apply_finished(self, finished: Dict[str, Finished]) -> None:
        """The samples the core finished (a stop token, a length limit, an error), unless the
        front-end ended them first."""
        for sample_id, ended in finished.items():
            sample = self._streams.get(sample_id)
            if sample is not None and sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason, sample.error = ended
                self._mark_advanced(sample)

    def _mark_advanced(self, sample: SampleStream) -> None:
        """The sample has news for the next delta."""
        sample.advanced = True
        self._advanced[sample.group_id] = self._groups[sample.group_id]

    def _die(self, err: EngineDeadError) -> None:
        """Fail every unfinished sample with the core's message and raise EngineDeadError with
        their last deltas."""
        self.dead_reason = self.core.dead_reason
        for sample in self._streams.values():
            if sample.finish_reason is None:
                sample.finish_reason, sample.error = _ERROR, str(err)
                self._mark_advanced(sample)
        raise EngineDeadError(str(err), self._take_deltas()) from err

    # ---- deltas -------------------------------------------------------------------------
    def _take_deltas(self) -> List[RequestOutput]:
        """A delta per group with news; finished groups are forgotten afterwards."""
        deltas = []
        sample_delta = self._sample_delta
        for group in self._advanced.values():
            samples = group.samples
            if len(samples) == 1:  # the common group: no comprehension or property per request
                sample = samples[0]
                outputs, finished, error = [sample_delta(sample)], sample.finish_reason is not None, sample.error
            else:
                outputs = [sample_delta(sample) for sample in samples if sample.advanced]
                finished, error = group.finished, group.error
            prompt_logprobs, ranks = self._prompt_logprobs_to_send(group) or (None, None)
            deltas.append(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                                        finished, error, group.metrics, prompt_logprobs, ranks))
            if finished:
                self._forget(group)
        self._advanced = {}
        return deltas

    @staticmethod
    def _prompt_logprobs_to_send(group: RequestGroup) -> Optional[Tuple[list, list]]:
        """(the prompt log-probs, their tokens' ranks), in the first delta that has them all."""
        state = group.prompt_logprobs
        if state is None or state.sent or state.missing:
            return None
        state.sent = True
        return state.values, state.ranks

    @staticmethod
    def _sample_delta(sample: SampleStream) -> CompletionOutput:
        sample.advanced = False
        finish_reason = sample.finish_reason
        tokens = sample.token_ids
        sent, sample.sent_tokens = sample.sent_tokens, len(tokens)
        text = take_text_delta(sample.detok, finish_reason is not None)
        if sample.logprobs is None:
            return CompletionOutput(sample.index, text, tokens[sent:], None, None, finish_reason, sample.stop_reason)
        return CompletionOutput(sample.index, text, tokens[sent:], sample.cumulative_logprob,
                                sample.logprobs[sent:], finish_reason, sample.stop_reason)

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        for sample in group.samples:
            self._streams.pop(sample.sample_id, None)

    # ---- figures and shutdown -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's figures (see ``EngineStats``)."""
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()
        unfreeze_heap()
