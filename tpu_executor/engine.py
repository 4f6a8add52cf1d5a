"""The engine: validates requests, runs scheduler -> executor -> detokenizer steps.

One bad request never takes the engine down: invalid input is rejected in ``add_request``
before anything is queued, and an error while a step runs fails only the requests of that
step (their blocks come back); the engine keeps serving the rest. A lost worker of a
tensor-parallel group (``WorkerFailure``) is different: the group cannot go on, so the
engine fails every in-flight request, shuts the workers down and raises ``EngineDeadError``.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

from tpu_executor.config import EngineConfig
from tpu_executor.detokenizer import Detokenizer, DetokenizerState
from tpu_executor.executor import WorkerFailure, executor_class_for
from tpu_executor.kv_cache_manager import KVCacheManager
from tpu_executor.request import CompletionOutput, Request, RequestOutput, RequestStatus
from tpu_executor.sampling_params import SamplingParams
from tpu_executor.scheduler import Scheduler

logger = logging.getLogger(__name__)

PromptType = Union[str, Dict[str, List[int]]]


@dataclass
class RequestGroup:
    """The ``n`` samples of one user request."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    samples: List[Request]
    states: List[DetokenizerState]
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)


class EngineDeadError(RuntimeError):
    """The engine lost a worker and shut down; ``outputs`` are the requests it failed."""

    def __init__(self, message: str, outputs: Optional[List[RequestOutput]] = None):
        super().__init__(message)
        self.outputs = outputs or []


@dataclass
class StartupStats:
    """What start-up cost: seconds per phase and compilations during warm-up."""

    num_blocks: int = 0
    compilations: int = 0
    seconds: Dict[str, float] = field(default_factory=dict)


class LLMEngine:
    """Continuous-batching generation engine over one executor."""

    def __init__(self, config: EngineConfig, tokenizer, executor_class=None, show_progress: bool = True):
        self.config = config
        self.tokenizer = tokenizer
        self.stats = StartupStats()
        self.vocab_size = 0
        self.dead_reason: Optional[str] = None
        self.executor = (executor_class or executor_class_for(config))(config)
        try:
            self._start_workers(show_progress)
        except BaseException:
            self.executor.shutdown()
            raise
        self.kv_cache = KVCacheManager(self.stats.num_blocks, config.cache.block_size,
                                       config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        self.detokenizer = Detokenizer(tokenizer, config.max_model_len)
        self._groups: Dict[str, RequestGroup] = {}
        self._group_of: Dict[str, RequestGroup] = {}
        self._requests: Dict[str, Request] = {}
        self._deferred: List[RequestGroup] = []
        self._seed_rng = random.Random(config.model.seed)
        self._counter = itertools.count()

    def _timed(self, phase: str, method: str, *args):
        start = time.perf_counter()
        result = self.executor.collective_rpc(method, *args)
        self.stats.seconds[phase] = time.perf_counter() - start
        return result

    def _start_workers(self, show_progress: bool) -> None:
        self._timed("init_device", "init_device")
        self.vocab_size = self._timed("load_model", "load_model")[0]
        # Every worker must fit the same cache: take the smallest.
        self.stats.num_blocks = min(self._timed("profile", "determine_num_blocks"))
        self._timed("init_cache", "init_cache", self.stats.num_blocks)
        self.stats.compilations = max(self._timed("warmup", "warmup", show_progress))

    # ---- requests -----------------------------------------------------------------------
    def prepare_prompt(self, prompt: PromptType, params: SamplingParams) -> List[int]:
        """The prompt's token ids, validated against the model and the engine's limits."""
        token_ids = self._prompt_token_ids(prompt)
        self._validate(token_ids, params)
        return token_ids

    def _prompt_token_ids(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        raise ValueError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _validate(self, token_ids: List[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt is empty: it has no tokens")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.config.max_model_len} (the prompt must leave room for output)")
        if params.logprobs is not None and params.logprobs > self.config.compile.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} exceeds max_logprobs "
                             f"{self.config.compile.max_logprobs} of this engine")

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    prompt_token_ids: Optional[List[int]] = None) -> str:
        """Validate and queue a request; returns its id. Invalid input raises ValueError.

        ``prompt_token_ids`` skips tokenising and validating again (from ``prepare_prompt``).
        """
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine has shut down: {self.dead_reason}")
        request_id = request_id if request_id is not None else str(next(self._counter))
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.prepare_prompt(prompt, params)
        samples = []
        for index in range(params.n):
            seed = params.seed + index if params.seed is not None else self._seed_rng.getrandbits(62)
            sample_id = request_id if params.n == 1 else f"{request_id}#{index}"
            samples.append(Request(sample_id, list(token_ids), params, seed,
                                   eos_token_id=self.tokenizer.eos_token_id))
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None,
                             list(token_ids), samples,
                             [self.detokenizer.new_state(token_ids) for _ in samples])
        self._groups[request_id] = group
        for sample in samples:
            self._requests[sample.request_id] = sample
            self._group_of[sample.request_id] = group
        # The other samples wait until the first has prefilled the prompt, so their prefill
        # takes its full blocks from the prefix cache instead of computing them again.
        self.scheduler.add(samples[0])
        if len(samples) > 1:
            self._deferred.append(group)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks return to the pool."""
        group = self._groups.get(request_id)
        for sample in group.samples if group else ():
            if not sample.is_finished:
                self.scheduler.finish(sample, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping -----------------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """One scheduling + model step; returns the outputs of requests that finished."""
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return self._collect_finished()
        try:
            sampled = self.executor.collective_rpc("execute_model", scheduled)[0]
        except WorkerFailure as err:
            self._shut_down_after(err)
        except Exception as err:  # a failed step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_step(scheduled, f"{type(err).__name__}: {err}")
            self._release_deferred_samples()
            return self._collect_finished()
        for request in self.scheduler.update(sampled, self._requests):
            self._process_token(request)
        self._release_deferred_samples()
        return self._collect_finished()

    def _release_deferred_samples(self) -> None:
        """Queue the remaining samples of groups whose first sample has been prefilled."""
        still_waiting = []
        for group in self._deferred:
            first = group.samples[0]
            if first.output_token_ids or first.is_finished:
                for sample in group.samples[1:]:
                    if not sample.is_finished:
                        self.scheduler.add(sample)
            else:
                still_waiting.append(group)
        self._deferred = still_waiting

    def _process_token(self, request: Request) -> None:
        group = self._group_of[request.request_id]
        state = group.states[group.samples.index(request)]
        new_text = self.detokenizer.append_token(state, request.all_token_ids)
        status = self.detokenizer.check_stop(request, state, new_text)
        if status is not None:
            self.scheduler.finish(request, status)

    def _fail_step(self, scheduled, message: str) -> None:
        ids = [w.request_id for w in scheduled.prefills] + [w.request_id for w in scheduled.decodes]
        for request_id in ids:
            request = self._requests[request_id]
            request.error = message
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)

    def _shut_down_after(self, failure: WorkerFailure) -> None:
        """Fail every in-flight request, stop the workers, raise EngineDeadError."""
        message = f"engine shut down: {failure}"
        logger.error(message)
        self.dead_reason = str(failure)
        for request in list(self._requests.values()):
            if not request.is_finished:
                request.error = message
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self._deferred = []
        self.executor.shutdown()
        raise EngineDeadError(message, self._collect_finished()) from failure

    def _collect_finished(self) -> List[RequestOutput]:
        done = [g for g in self._groups.values() if g.finished]
        for group in done:
            del self._groups[group.request_id]
            for sample in group.samples:
                self._requests.pop(sample.request_id, None)
                self._group_of.pop(sample.request_id, None)
        return [self._output(group) for group in done]

    @staticmethod
    def _output(group: RequestGroup) -> RequestOutput:
        outputs = []
        for index, (sample, state) in enumerate(zip(group.samples, group.states)):
            wants = sample.sampling_params.logprobs is not None
            outputs.append(CompletionOutput(
                index, state.text, list(sample.output_token_ids),
                sample.cumulative_logprob if wants else None,
                list(sample.output_logprobs) if wants else None,
                sample.finish_reason(), sample.stop_reason))
        errors = [s.error for s in group.samples if s.error]
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             finished=True, error=errors[0] if errors else None)

    def compilations_since_warmup(self) -> int:
        """XLA compilations after warm-up (the worst rank's)."""
        return max(self.executor.collective_rpc("compilations_since_warmup"))

    def shutdown(self) -> None:
        self.executor.shutdown()
