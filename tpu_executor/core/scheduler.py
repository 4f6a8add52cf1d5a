"""Continuous-batching scheduler (pure Python).

Each step first gives every running request a slot for one more token (preempting the most
recently admitted requests by recompute when blocks run out), then admits waiting requests as
prefills while ``max_num_seqs``, ``max_num_batched_tokens`` and the free blocks allow. A
preempted request loses its blocks and returns to the front of the queue; its prompt and the
tokens it already produced are prefilled again, so nothing it generated is lost.

Asynchronous scheduling: the next step may be scheduled while the previous one still runs, so a
request can have a token in flight (``num_in_flight``). Its decode then takes ``PENDING_TOKEN``
as input, one position further on, and counts that token for its blocks and sampling step. A
request whose in-flight token already reaches ``max_tokens`` or ``max_model_len`` is not
scheduled again; one that turns out finished (EOS, a stop string) computes one more token,
which ``update`` discards. A preempted request with a token in flight is not prefilled again
until the token is back (the prefill must include it).
"""
from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List

from tpu_executor.core.config import SchedulerConfig
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, PrefillWork, SampledToken, SamplingMeta, SchedulerOutput


def sampling_meta(request: Request) -> SamplingMeta:
    """The sampler's view of ``request`` at its next output position (in-flight tokens count)."""
    params = request.sampling_params
    return SamplingMeta(params.temperature, params.top_k, params.top_p, params.min_p, request.seed,
                        len(request.output_token_ids) + request.num_in_flight,
                        -1 if params.logprobs is None else params.logprobs)


class Scheduler:
    """Decides the prefill and decode work of each step and owns the request queues."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished (any status) and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """The next step's work: decodes of running requests first, then new prefills."""
        decodes = self._schedule_decodes()
        prefills = self._schedule_prefills(self.config.max_num_batched_tokens - len(decodes), bool(decodes))
        return SchedulerOutput(prefills=tuple(prefills), decodes=tuple(decodes))

    def _schedule_decodes(self) -> List[DecodeWork]:
        decodes: List[DecodeWork] = []
        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_tokens = request.num_tokens + request.num_in_flight
            if request.num_in_flight and self._reaches_limit(request, num_tokens):
                index += 1  # its in-flight token is its last
                continue
            while not self.kv_cache.allocate(request.request_id, num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is request:
                    break
            else:
                token_id = PENDING_TOKEN if request.num_in_flight else request.last_token_id
                decodes.append(DecodeWork(request.request_id, token_id, num_tokens - 1,
                                          tuple(self.kv_cache.block_ids(request.request_id)), sampling_meta(request)))
                request.num_in_flight += 1
                index += 1
        return decodes

    def _reaches_limit(self, request: Request, num_tokens: int) -> bool:
        """Whether a request with ``num_tokens`` (in-flight included) has no token left to make."""
        num_outputs = num_tokens - len(request.prompt_token_ids)
        return num_outputs >= request.sampling_params.max_tokens or num_tokens >= self.max_model_len

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_prefills(self, budget: int, has_decodes: bool) -> List[PrefillWork]:
        prefills: List[PrefillWork] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_in_flight:
                break  # preempted with a token still coming: its prefill must include it
            tokens = request.all_token_ids
            cached, num_cached = self.kv_cache.find_cached_prefix(tokens)
            num_new = len(tokens) - num_cached
            if num_new > budget and (prefills or has_decodes):
                break
            if not self.kv_cache.allocate(request.request_id, len(tokens), cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            self.running.append(request)
            budget -= num_new
            prefills.append(PrefillWork(
                request.request_id, tuple(tokens[num_cached:]), num_cached,
                tuple(self.kv_cache.block_ids(request.request_id)), sampling_meta(request)))
            request.num_in_flight += 1
        return prefills

    def update(self, sampled: Dict[str, SampledToken], requests: Dict[str, Request]) -> List[Request]:
        """Record each sampled token; returns the requests that got one (not finished; a
        request preempted while its token was in flight keeps the token and waits)."""
        updated = []
        for request_id, token in sampled.items():
            request = requests.get(request_id)
            if request is None or request.is_finished:
                continue  # aborted, or finished by the token before this one: discarded
            request.num_in_flight -= 1
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens = request.num_tokens
                self.kv_cache.cache_computed_blocks(request_id, request.all_token_ids,
                                                    request.num_computed_tokens)
            request.output_token_ids.append(token.token_id)
            request.cumulative_logprob += token.logprob
            if token.top_logprobs is not None:
                request.output_logprobs.append({token.token_id: token.logprob, **token.top_logprobs})
            updated.append(request)
        return updated
