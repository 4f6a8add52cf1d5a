"""The engine: validates requests, runs scheduler -> executor -> detokenizer steps, and hands
out what each step produced as deltas.

One bad request never takes the engine down: invalid input is rejected in ``add_request``
before anything is queued, and an error while a step runs fails only the requests of that
step (their blocks come back); the engine keeps serving the rest. A lost or unresponsive
worker (``WorkerFailure``) is different: the tensor-parallel group cannot go on, so the engine
fails every in-flight request, shuts the workers down and raises ``EngineDeadError``.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from tpu_executor.core.buckets import BucketPlan
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.detokenizer import Detokenizer, DetokenizerState, take_text_delta
from tpu_executor.core.heap import freeze_startup_heap, unfreeze_heap
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.core.request import CompletionOutput, Request, RequestMetrics, RequestOutput, RequestStatus
from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams
from tpu_executor.core.scheduler import Scheduler
from tpu_executor.core.step import ModelRunnerOutput, PrefillWork, SchedulerOutput, WorkerStats
from tpu_executor.engine.options import build_engine_config
from tpu_executor.engine.stats import EngineStats
from tpu_executor.executor import Executor, WorkerFailure, executor_class_for
from tpu_executor.executor.base import completed_future

logger = logging.getLogger(__name__)

PromptType = Union[str, Dict[str, List[int]]]


@dataclass(slots=True)
class SampleStream:
    """What one sample has produced and how much of it has gone out in deltas."""

    request: Request
    detok: DetokenizerState
    group_id: str
    index: int  # among the group's samples
    final_only: bool  # the request wants one output when it finishes (RequestOutputKind.FINAL_ONLY)
    sent_tokens: int = 0
    advanced: bool = False  # has news for the next delta


@dataclass
class RequestGroup:
    """The ``n`` samples of one user request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    samples: List[SampleStream]
    metrics: RequestMetrics

    # Both are read for every request on every step; a loop instead of a generator keeps the
    # common one-sample group cheap.
    @property
    def finished(self) -> bool:
        for sample in self.samples:
            if not sample.request.status.is_finished:
                return False
        return True

    @property
    def error(self) -> Optional[str]:
        for sample in self.samples:
            if sample.request.error:
                return sample.request.error
        return None


class EngineDeadError(RuntimeError):
    """The engine lost a worker and shut down; ``outputs`` are the last deltas of the requests
    it failed."""

    def __init__(self, message: str, outputs: Optional[List[RequestOutput]] = None):
        super().__init__(message)
        self.outputs = outputs or []


class LLMEngine:
    """Continuous-batching generation engine over one executor.

    ``executor`` defaults to the one the config asks for (in-process, or Ray actors for
    tensor parallelism); the engine owns it and shuts it down.
    """

    def __init__(self, config: EngineConfig, tokenizer, executor: Optional[Executor] = None,
                 show_progress: bool = True):
        self.config = config
        self.tokenizer = tokenizer
        self.dead_reason: Optional[str] = None
        self.executor = executor if executor is not None else executor_class_for(config)(config)
        self._startup_seconds: Dict[str, float] = {}
        try:
            num_blocks = self._start_workers(show_progress)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, config.max_model_len,
                                   BucketPlan.from_config(config).max_prefill_tokens)
        self.detokenizer = Detokenizer(tokenizer, config.max_model_len)
        self._groups: Dict[str, RequestGroup] = {}
        self._streams: Dict[str, SampleStream] = {}  # sample id -> its stream
        self._requests: Dict[str, Request] = {}  # sample id -> its request
        self._deferred: List[RequestGroup] = []
        self._advanced: Dict[str, RequestGroup] = {}  # groups with samples that have news, by id
        self._worker_stats = WorkerStats()
        self._seed_rng = random.Random(config.model.seed)
        self._counter = itertools.count()
        self.timer = NullPhaseTimer()  # bench host swaps in a PhaseTimer
        # The step started but not yet read back (asynchronous scheduling).
        self._in_flight: Optional[Tuple[SchedulerOutput, "Future[ModelRunnerOutput]"]] = None
        # Ready to serve: later collections skip what start-up built (see core/heap.py).
        freeze_startup_heap()

    @classmethod
    def from_options(cls, model: str, show_progress: bool = True, worker_class: Optional[type] = None,
                     **options) -> "LLMEngine":
        """An engine for the checkpoint at ``model`` from flat engine options (see
        ``engine/options.py``). ``worker_class`` swaps in a ``Worker`` subclass (tests inject
        faults with it)."""
        from transformers import AutoTokenizer

        config = build_engine_config(model, **options)
        executor = executor_class_for(config)(config, worker_class=worker_class)
        return cls(config, AutoTokenizer.from_pretrained(model), executor=executor, show_progress=show_progress)

    def _timed(self, phase: str, call, *args):
        start = time.perf_counter()
        result = call(*args)
        self._startup_seconds[phase] = time.perf_counter() - start
        return result

    def _start_workers(self, show_progress: bool) -> int:
        """Bring every worker up; returns the number of KV blocks they all hold."""
        executor = self.executor
        self._timed("init_device", executor.init_device)
        self.vocab_size = self._timed("load_model", executor.load_model)
        num_blocks = self._timed("profile", executor.determine_num_blocks)
        self._timed("init_cache", executor.init_cache, num_blocks)
        self._timed("warmup", executor.warmup, show_progress)
        return num_blocks

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """The prompt's token ids, validated against the model and the engine's limits."""
        token_ids = self._prompt_token_ids(prompt)
        self.validate_prompt(token_ids, params)
        return token_ids

    def _prompt_token_ids(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: List[int], params: SamplingParams) -> None:
        """Raise ValueError if ``token_ids`` cannot run on this engine with ``params``. Reads
        only the config, so other threads may call it while the engine steps."""
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.config.max_model_len} tokens, "
                             f"but the prompt has {len(token_ids)} tokens (it must leave room for output; "
                             "max_model_len sets the limit)")
        if params.logprobs is not None and params.logprobs > self.config.compile.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds max_logprobs "
                             f"{self.config.compile.max_logprobs} of this engine")

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    prompt_token_ids: Optional[List[int]] = None, arrival_time: Optional[float] = None) -> str:
        """Validate and queue a request; returns its id. Invalid input raises ValueError.

        ``prompt_token_ids`` skips tokenising and validating again (from ``prepare_prompt``);
        ``arrival_time`` (``time.monotonic()``) is when it reached the server, default now.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has shut down: {self.dead_reason}")
        request_id = request_id if request_id is not None else str(next(self._counter))
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.prepare_prompt(prompt, params)
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None, list(token_ids),
                             [self._new_sample(request_id, token_ids, params, index) for index in range(params.n)],
                             RequestMetrics(arrival_time if arrival_time is not None else time.monotonic()))
        self._groups[request_id] = group
        for sample in group.samples:
            self._streams[sample.request.request_id] = sample
            self._requests[sample.request.request_id] = sample.request
        # The other samples wait until the first has prefilled the prompt, so their prefill
        # takes its full blocks from the prefix cache instead of computing them again.
        self.scheduler.add(group.samples[0].request)
        if params.n > 1:
            self._deferred.append(group)
        return request_id

    def _new_sample(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    index: int) -> SampleStream:
        seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(62)
        sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
        request = Request(sample_id, list(token_ids), params, seed, eos_token_id=self.tokenizer.eos_token_id)
        return SampleStream(request, self.detokenizer.new_state(request), request_id, index,
                            params.output_kind is RequestOutputKind.FINAL_ONLY)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return to the pool at once, and the next
        ``step()`` hands out its last delta (finish reason ``abort``)."""
        group = self._groups.get(request_id)
        for sample in group.samples if group else ():
            if not sample.request.is_finished:
                self.scheduler.finish(sample.request, RequestStatus.FINISHED_ABORTED)
                self._mark_advanced(sample)

    def abort_all_requests(self) -> None:
        """Abort every request in the engine (shutdown)."""
        for request_id in list(self._groups):
            self.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request still runs, waits, or has a delta not yet handed out."""
        # A deferred sample's group always has its first sample in the scheduler.
        return self.scheduler.has_unfinished() or bool(self._advanced) or self._in_flight is not None

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """One scheduling + model step; returns a delta per request that advanced.

        With asynchronous scheduling the step just scheduled is started and left running while
        the previous one's tokens are read, detokenized and checked for stops: each call
        returns the previous step's deltas, and the device never waits for that host work.
        """
        with self.timer.phase("schedule"):
            scheduled = self.scheduler.schedule()
        started = self._start(scheduled) if not scheduled.is_empty else None
        if self.config.scheduler.async_scheduling:
            started, self._in_flight = self._in_flight, started  # finish the previous step instead
        if started is not None:
            self._finish(*started)
        with self.timer.phase("schedule"):
            self._release_deferred_samples()
        with self.timer.phase("output"):
            return self._take_deltas()

    def _start(self, scheduled: SchedulerOutput) -> Optional[Tuple[SchedulerOutput, "Future[ModelRunnerOutput]"]]:
        """Hand the step to the executor (left running when scheduling is asynchronous, run to
        the end otherwise); None if it could not even start (its requests fail)."""
        now = time.monotonic()
        for work in scheduled.prefills:
            metrics = self._group_metrics(work.request_id)
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        try:
            if self.config.scheduler.async_scheduling:
                return scheduled, self.executor.execute_model_async(scheduled)
            return scheduled, completed_future(lambda: self.executor.execute_model(scheduled))
        except WorkerFailure as err:
            self._shut_down_after(err)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("engine step failed to start")
            self._fail(scheduled.request_ids, f"{type(err).__name__}: {err}")
        return None

    def _finish(self, scheduled: SchedulerOutput, running: "Future[ModelRunnerOutput]") -> None:
        """Wait for a started step; record its tokens, detokenize, apply stop conditions."""
        try:
            output = running.result()
        except WorkerFailure as err:
            self._shut_down_after(err)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail(scheduled.request_ids, f"{type(err).__name__}: {err}")
            return
        if output.error is not None:
            logger.error("engine step failed: %s", output.error)
            self._fail(scheduled.request_ids, output.error)
            return
        with self.timer.phase("output"):
            updated = self.scheduler.update(output.sampled, self._requests)
            self._note_first_tokens(scheduled.prefills)
        with self.timer.phase("detokenize"):
            self._process_tokens(updated)

    def _note_first_tokens(self, prefills: Sequence[PrefillWork]) -> None:
        """The time a request's first token came back: the step that ran the last chunk of
        its first prefill (a few prefills per step, so no pass over the running requests)."""
        now = time.monotonic()
        for work in prefills:
            metrics = self._group_metrics(work.request_id) if work.is_last_chunk else None
            if metrics is not None and metrics.first_token_time is None:
                metrics.first_token_time = now

    def _group_metrics(self, sample_id: str) -> Optional[RequestMetrics]:
        """The metrics of the sample's request (None once the request is forgotten)."""
        sample = self._streams.get(sample_id)
        return None if sample is None else self._groups[sample.group_id].metrics

    def _release_deferred_samples(self) -> None:
        """Queue the remaining samples of groups whose first sample has been prefilled."""
        still_waiting = []
        for group in self._deferred:
            first = group.samples[0].request
            if first.output_token_ids or first.is_finished:
                for sample in group.samples[1:]:
                    if not sample.request.is_finished:
                        self.scheduler.add(sample.request)
            else:
                still_waiting.append(group)
        self._deferred = still_waiting

    def _process_tokens(self, updated: List[Request]) -> None:
        """Detokenize each request's new token and apply its stop conditions. This loop runs
        for every running sequence on every step: ``_mark_advanced`` is inlined."""
        streams, groups, advanced = self._streams, self._groups, self._advanced
        advance, finish = self.detokenizer.advance, self.scheduler.finish
        for request in updated:
            sample = streams[request.request_id]
            status = advance(request, sample.detok)
            if status is not None:
                finish(request, status)
            elif sample.final_only:
                continue  # nothing goes out before the end
            sample.advanced = True
            advanced[sample.group_id] = groups[sample.group_id]

    def _mark_advanced(self, sample: SampleStream) -> None:
        """The sample has news for the next delta."""
        sample.advanced = True
        self._advanced[sample.group_id] = self._groups[sample.group_id]

    def _fail(self, sample_ids: Sequence[str], message: str) -> None:
        """Finish the given samples with an error (their blocks come back)."""
        for sample_id in sample_ids:
            sample = self._streams[sample_id]
            request = sample.request
            if not request.is_finished:
                request.error = message
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                self._mark_advanced(sample)

    def _shut_down_after(self, failure: WorkerFailure) -> None:
        """Fail every in-flight request, stop the workers, raise EngineDeadError."""
        message = f"engine shut down: {failure}"
        logger.error(message)
        self.dead_reason = str(failure)
        self._fail(list(self._streams), message)
        self._deferred = []
        self._in_flight = None
        self.shutdown()
        raise EngineDeadError(message, self._take_deltas()) from failure

    # ---- deltas -------------------------------------------------------------------------
    def _take_deltas(self) -> List[RequestOutput]:
        """A delta per group with news; finished groups are forgotten afterwards."""
        deltas = []
        sample_delta = self._sample_delta
        for group in self._advanced.values():
            samples = group.samples
            if len(samples) == 1:  # the common group: no comprehension or property per request
                request = samples[0].request
                outputs, finished, error = [sample_delta(samples[0])], request.status.is_finished, request.error
            else:
                outputs = [sample_delta(sample) for sample in samples if sample.advanced]
                finished, error = group.finished, group.error
            deltas.append(RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                                        finished, error, group.metrics))
            if finished:
                self._forget(group)
        self._advanced = {}
        return deltas

    @staticmethod
    def _sample_delta(sample: SampleStream) -> CompletionOutput:
        sample.advanced = False
        request = sample.request
        finish_reason = request.status.finish_reason
        outputs = request.output_token_ids
        sent, sample.sent_tokens = sample.sent_tokens, len(outputs)
        params = request.sampling_params
        text = take_text_delta(sample.detok, finish_reason is not None)
        if params.logprobs is None:
            return CompletionOutput(sample.index, text, outputs[sent:], None, None, finish_reason, request.stop_reason)
        return CompletionOutput(sample.index, text, outputs[sent:], request.cumulative_logprob,
                                request.output_logprobs[sent:], finish_reason, request.stop_reason)

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        for sample in group.samples:
            self._streams.pop(sample.request.request_id, None)
            self._requests.pop(sample.request.request_id, None)

    # ---- figures and shutdown -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's figures (see ``EngineStats``)."""
        if self.dead_reason is None:
            self._worker_stats = self.executor.stats()
        worker, kv = self._worker_stats, self.kv_cache
        deferred = sum(1 for g in self._deferred for s in g.samples[1:] if not s.request.is_finished)
        return EngineStats(
            startup_seconds=dict(self._startup_seconds),
            graphs_compiled_at_warmup=worker.graphs_compiled_at_warmup,
            graphs_compiled_after_warmup=worker.graphs_compiled_after_warmup,
            padding=worker.padding, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_query_tokens, prefix_cache_hits=kv.prefix_hit_tokens,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting + deferred,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_usable_blocks,
            kv_cache_bytes=worker.kv_cache_bytes)

    def shutdown(self) -> None:
        self.executor.shutdown()
        unfreeze_heap()
