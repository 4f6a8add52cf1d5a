"""The engine core: scheduler, KV-cache manager and executor, stepping on token ids alone.

It knows requests as ``Request`` objects and hands back, per step, the tokens it recorded and
the samples that finished (a stop token, a length limit, an error). Text is not its business:
detokenizing, stop strings and the deltas users read are the front-end's
(``engine/llm_engine.py``), which tells the core when a stop string ended a sample. So the
core's work per step is what keeps the device fed, and nothing else (vLLM v1 splits its engine
the same way, and runs the two parts in separate processes).

One bad request never takes the core down: an error while a step runs fails only the
requests of that step (their blocks come back). A lost or unresponsive worker
(``WorkerFailure``) is different: the tensor-parallel group cannot go on, so the core shuts
the workers down and raises ``EngineDeadError``.
"""
from __future__ import annotations

import copy
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from tpu_executor.core.buckets import BucketPlan
from tpu_executor.core.config import EngineConfig, fit_max_model_len
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.scheduler import Scheduler
from tpu_executor.core.step import (
    LoRAFailure,
    ModelRunnerOutput,
    PromptLogprobs,
    SampledTokens,
    SchedulerOutput,
    WorkerStats,
    completed_future,
)
from tpu_executor.engine.drafter import make_drafter
from tpu_executor.engine.stats import EngineStats
from tpu_executor.engine.structured_outputs import GrammarCompiler, GrammarMatchers
from tpu_executor.executor import Executor, WorkerFailure

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine lost a worker and shut down; ``outputs`` are the last deltas of the requests
    it failed."""

    def __init__(self, message: str, outputs: Optional[List] = None):
        super().__init__(message)
        self.outputs = outputs or []


class Finished(NamedTuple):
    """How the core finished a sample: ``finish_reason`` as in vLLM (``stop``, ``length``,
    ``error``), the stop token id that ended it (None for the EOS), the error's message."""

    finish_reason: str
    stop_reason: Optional[int] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class CoreOutput:
    """What one core step produced, by sample id: the tokens recorded (a row each, in the
    order sampled), the samples that finished (those the front-end finished too, once the core
    has let them go), and the times the metrics need (a sample's prefill first scheduled; a
    prompt's last chunk read back, so its first token)."""

    tokens: SampledTokens = field(default_factory=SampledTokens)
    finished: Dict[str, Finished] = field(default_factory=dict)
    scheduled_at: Tuple[Tuple[str, float], ...] = ()
    first_token_at: Tuple[Tuple[str, float], ...] = ()
    prompt_logprobs: Tuple[PromptLogprobs, ...] = ()


class EngineCore:
    """Continuous batching over one executor, in token ids.

    It starts the executor's workers, sizes the KV cache from what they can hold, and owns the
    executor from then on (``shutdown`` stops it).
    """

    def __init__(self, config: EngineConfig, executor: Executor, show_progress: bool = True):
        self.config = config
        self.executor = executor
        self.dead_reason: Optional[str] = None
        self.startup_seconds: Dict[str, float] = {}
        try:
            num_blocks = self._start_workers(show_progress)
        except BaseException:
            executor.shutdown()
            raise
        config = self.config  # with max_model_len fitted to the cache
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, config.max_model_len,
                                   BucketPlan.from_config(config).max_prefill_tokens,
                                   make_drafter(config.speculative),
                                   config.lora.max_loras if config.lora.enable_lora else 0, config.lora.max_cpu_loras)
        self._requests: Dict[str, Request] = {}  # sample id -> its request, until it finishes
        # Samples the front-end finished since the last step: the next output confirms them, so
        # a front-end in another process knows when no token of theirs can come any more.
        self._confirmed: Dict[str, Finished] = {}
        # Groups whose first sample still prefills: that sample, and the others waiting for it.
        self._deferred: List[Tuple[Request, List[Request]]] = []
        self._worker_stats = WorkerStats()
        self.timer = NullPhaseTimer()  # see attach_phase_timer
        # The step started but not yet read back (asynchronous scheduling).
        self._in_flight: Optional[Tuple[SchedulerOutput, "Future[ModelRunnerOutput]"]] = None
        self.grammars: Optional[GrammarMatchers] = None  # see use_grammars

    def _timed(self, phase: str, call, *args):
        start = time.perf_counter()
        result = call(*args)
        self.startup_seconds[phase] = time.perf_counter() - start
        return result

    def _start_workers(self, show_progress: bool) -> int:
        """Bring every worker up; returns the number of KV blocks they all hold."""
        executor, config_limit = self.executor, self.config.max_model_len
        self._timed("init_device", executor.init_device)
        self.vocab_size = self._timed("load_model", executor.load_model)
        num_blocks = self._timed("profile", executor.determine_num_blocks)
        self.config = fit_max_model_len(self.config, num_blocks)
        if self.config.max_model_len < config_limit:
            logger.warning("max_model_len lowered from %d to %d tokens: what the KV cache holds (raise "
                           "memory_budget_bytes / memory_utilization for more)", config_limit,
                           self.config.max_model_len)
        self._timed("init_cache", executor.init_cache, num_blocks, self.config.max_model_len)
        self._timed("warmup", executor.warmup, show_progress)
        return num_blocks

    def attach_phase_timer(self, timer):
        """Time this core's phases and its worker's with ``timer`` (benchmarks); returns the
        in-process model runner (see ``LLMEngine.attach_phase_timer``)."""
        self.timer = timer
        return self.executor.attach_phase_timer(timer)

    def use_grammars(self, compiler: GrammarCompiler) -> None:
        """Constrain samples with ``structured_outputs`` through ``compiler`` (the front-end's:
        its grammars are compiled already when their requests arrive)."""
        self.grammars = GrammarMatchers(compiler)

    # ---- requests -----------------------------------------------------------------------
    def add(self, samples: Sequence[Request]) -> None:
        """Queue the samples of one request. The others wait until the first has prefilled the
        prompt, so their prefill takes its full blocks from the prefix cache instead of
        computing them again."""
        for sample in samples:
            self._requests[sample.request_id] = sample
            spec = sample.sampling_params.structured_outputs
            if spec is not None:
                if self.grammars is None:
                    raise RuntimeError("a request has structured_outputs but the core has no grammar compiler")
                self.grammars.add(sample.request_id, spec, sample.prompt_token_ids)
        self.scheduler.add(samples[0])
        if len(samples) > 1:
            self._deferred.append((samples[0], list(samples[1:])))

    def finish(self, sample_ids: Sequence[str], status: RequestStatus) -> None:
        """Finish samples the front-end ended (abort, a stop string); their blocks return to
        the pool at once, and tokens still in flight for them are discarded."""
        for sample_id in sample_ids:
            request = self._forget(sample_id)
            if request is not None:
                self._confirmed[sample_id] = Finished(status.finish_reason)
                if not request.is_finished:
                    self.scheduler.finish(request, status)

    def has_sample(self, sample_id: str) -> bool:
        """Whether the core still holds the sample (its id is not free for a new request)."""
        return sample_id in self._requests

    def has_unfinished(self) -> bool:
        """Whether a sample still runs or waits, or a step is still in flight."""
        # A deferred sample's group always has its first sample in the scheduler.
        return self.scheduler.has_unfinished() or self._in_flight is not None

    @property
    def num_waiting(self) -> int:
        """Samples queued but not running (deferred samples of a group included)."""
        deferred = sum(1 for _, samples in self._deferred for sample in samples if not sample.is_finished)
        return self.scheduler.num_waiting + deferred

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> CoreOutput:
        """One scheduling + model step. With asynchronous scheduling the step just scheduled
        is started and left running while the previous one's tokens are recorded: the output
        is the previous step's, and the device never waits for the host's work on it."""
        with self.timer.phase("schedule"):
            scheduled = self.scheduler.schedule()
        finished, self._confirmed = self._confirmed, {}
        scheduled_at = self._scheduled_at(scheduled)
        output = None
        if self.grammars and self.grammars.constrains_any(scheduled.sampled_request_ids):
            scheduled, output = self._with_token_masks(scheduled, finished)
        started = self._start(scheduled, finished) if not scheduled.is_empty else None
        if self.config.scheduler.async_scheduling:
            started, self._in_flight = self._in_flight, started  # finish the previous step instead
        if started is not None:
            output = self._finish(*started, finished)
        with self.timer.phase("schedule"):
            self._release_deferred_samples()
        if output is None:
            return CoreOutput(SampledTokens(), finished, scheduled_at)
        tokens, first_token_at, prompt_logprobs = output
        return CoreOutput(tokens, finished, scheduled_at, first_token_at, prompt_logprobs)

    def _with_token_masks(self, scheduled: SchedulerOutput, finished: Dict[str, Finished]) -> tuple:
        """``scheduled`` with its constrained rows' grammar bitmasks, and the output of the step
        that was in flight (finished first: the masks depend on its tokens), or None."""
        output = None
        if self._in_flight is not None:
            output = self._finish(*self._in_flight, finished)
            self._in_flight = None
        with self.timer.phase("schedule"):  # the grammars' share of scheduling
            masks = self.grammars.bitmasks(scheduled.sampled_request_ids)
        return replace(scheduled, token_bitmasks=masks), output

    @staticmethod
    def _scheduled_at(scheduled: SchedulerOutput) -> Tuple[Tuple[str, float], ...]:
        """Each prefill's sample and the time (a few prefills a step, so no pass over all)."""
        now = time.monotonic()
        return tuple((work.request_id, now) for work in scheduled.prefills)

    def _start(self, scheduled: SchedulerOutput,
               finished: Dict[str, Finished]) -> Optional[Tuple[SchedulerOutput, "Future[ModelRunnerOutput]"]]:
        """Hand the step to the executor (left running when scheduling is asynchronous, run to
        the end otherwise); None if it could not even start (its requests fail)."""
        try:
            if self.config.scheduler.async_scheduling:
                return scheduled, self.executor.execute_model_async(scheduled)
            return scheduled, completed_future(lambda: self.executor.execute_model(scheduled))
        except WorkerFailure as err:
            self._shut_down_after(err)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("engine step failed to start")
            self._fail_step(scheduled, f"{type(err).__name__}: {err}", finished)
        return None

    def _finish(self, scheduled: SchedulerOutput, running: "Future[ModelRunnerOutput]",
                finished: Dict[str, Finished]) -> Optional[tuple]:
        """Wait for a started step and record its tokens (samples they end go to
        ``finished``); returns the tokens recorded, the prompts whose first token came and the
        prompt log-probs the step gave (None when it failed)."""
        try:
            output = running.result()
        except WorkerFailure as err:
            self._shut_down_after(err)
        except Exception as err:  # noqa: BLE001 - a failed step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_step(scheduled, f"{type(err).__name__}: {err}", finished)
            return None
        if output.error is not None:
            logger.error("engine step failed: %s", output.error)
            self._fail_step(scheduled, output.error, finished)
            return None
        self._fail_adapters(scheduled, output.lora_failures, finished)
        with self.timer.phase("output"):
            tokens, ended = self.scheduler.update(output.sampled, self._requests, output.drafts)
            for request in ended:
                finished[request.request_id] = Finished(request.status.finish_reason, request.stop_reason)
                self._forget(request.request_id)
        if self.grammars:
            self._advance_grammars(tokens, finished)
        now = time.monotonic()
        first = tuple((work.request_id, now) for work in scheduled.prefills if work.is_last_chunk)
        return tokens, first, output.prompt_logprobs

    def _advance_grammars(self, tokens: SampledTokens, finished: Dict[str, Finished]) -> None:
        """Advance the constrained samples' matchers by their recorded tokens (a token its
        grammar refuses fails the sample: the mask let it through, which must not happen)."""
        with self.timer.phase("output"):
            for sample_id, token_id in zip(tokens.request_ids, tokens.token_ids):
                error = self.grammars.accept(sample_id, token_id)
                if error is not None:
                    logger.error("%s: %s", sample_id, error)
                    self._fail([sample_id], error, finished)

    def _forget(self, sample_id: str) -> Optional[Request]:
        """Let go of a sample the core no longer steps (its matcher too); returns it."""
        if self.grammars is not None:
            self.grammars.remove(sample_id)
        return self._requests.pop(sample_id, None)

    def _release_deferred_samples(self) -> None:
        """Queue the remaining samples of groups whose first sample has been prefilled."""
        still_waiting = []
        for first, samples in self._deferred:
            if first.output_token_ids or first.is_finished:
                for sample in samples:
                    if not sample.is_finished:
                        self.scheduler.add(sample)
            else:
                still_waiting.append((first, samples))
        self._deferred = still_waiting

    def _fail(self, sample_ids: Sequence[str], message: str, finished: Dict[str, Finished]) -> None:
        """Finish the given samples with an error (their blocks come back)."""
        for sample_id in sample_ids:
            request = self._forget(sample_id)
            if request is not None and not request.is_finished:
                request.error = message
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
                finished[sample_id] = Finished(RequestStatus.FINISHED_ERROR.finish_reason, None, message)

    def _fail_step(self, scheduled: SchedulerOutput, message: str, finished: Dict[str, Finished]) -> None:
        """Fail every request of a step that failed; the adapters it wrote into slots count as
        not written (the writes may have stopped half way), so their slots are emptied."""
        self._fail(scheduled.request_ids, message, finished)
        failures = [LoRAFailure(slot, lora.lora_int_id, f"LoRA adapter {lora.lora_name!r} was not loaded: the step "
                                f"that loaded it failed ({message})")
                    for slot, lora in dict(scheduled.lora_loads).items() if lora is not None]
        self._fail_adapters(scheduled, failures, finished)

    def _fail_adapters(self, scheduled: SchedulerOutput, failures: Sequence[LoRAFailure],
                       finished: Dict[str, Finished]) -> None:
        """Fail the requests of each adapter the workers could not write into its slot for
        ``scheduled``, before the step's tokens are recorded (theirs are discarded: they ran
        on an empty slot); the scheduler forgets the slot holds it."""
        for failure in failures:
            logger.error("%s (slot %d)", failure.message, failure.slot)
            doomed = self.scheduler.adapter_failed(failure.slot, failure.lora_int_id, scheduled)
            self._fail(doomed, failure.message, finished)

    def forget_lora(self, lora_int_id: int) -> None:
        """Unload adapter ``lora_int_id``: the workers zero its slot once no running request
        uses it, and a later request for the id reads it from disk again."""
        if self.scheduler.adapters is not None:
            self.scheduler.adapters.forget(lora_int_id)

    def _shut_down_after(self, failure: WorkerFailure) -> None:
        """Stop the workers and raise EngineDeadError (the front-end fails what was running)."""
        message = f"engine shut down: {failure}"
        logger.error(message)
        self.dead_reason = str(failure)
        self._fail(list(self._requests), message, {})  # the scheduler lets every request go
        self._deferred = []
        self._in_flight = None
        self.shutdown()
        raise EngineDeadError(message) from failure

    # ---- figures and shutdown -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the core's figures (see ``EngineStats``)."""
        if self.dead_reason is None:
            self._worker_stats = self.executor.stats()
        worker, kv = self._worker_stats, self.kv_cache
        return EngineStats(
            startup_seconds=dict(self.startup_seconds),
            graphs_compiled_at_warmup=worker.graphs_compiled_at_warmup,
            graphs_compiled_after_warmup=worker.graphs_compiled_after_warmup,
            padding=worker.padding, num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=kv.prefix_query_tokens, prefix_cache_hits=kv.prefix_hit_tokens,
            num_running=self.scheduler.num_running, num_waiting=self.num_waiting,
            kv_blocks_used=kv.num_used_blocks, kv_blocks_total=kv.num_usable_blocks,
            kv_cache_bytes=worker.kv_cache_bytes, compile_cache_hits=worker.compile_cache_hits,
            compile_cache_misses=worker.compile_cache_misses, compile_seconds=worker.compile_seconds,
            kernel_providers=worker.kernel_providers, spec_decode=copy.deepcopy(self.scheduler.spec),
            lora_slots_in_use=self.scheduler.adapters.slots_in_use if self.scheduler.adapters is not None else 0)

    def shutdown(self) -> None:
        self.executor.shutdown()
