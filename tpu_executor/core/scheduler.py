"""Continuous-batching scheduler (pure Python).

Each step first gives every decoding request a slot for one more token (preempting the most
recently admitted requests by recompute when blocks run out), then spends what is left of the
token budget (``max_num_batched_tokens``) on prefills: the next chunks of prompts already
running, then waiting requests while ``max_num_seqs`` and the free blocks allow. With chunked
prefill a prompt longer than what is left of the budget is cut into chunks, one per step, each
reading the earlier ones' K/V from the pages like a prefix-cache hit; only the last chunk is
sampled. Without it a prompt runs whole, in a step of its own if it exceeds the budget. A
preempted request loses its blocks and returns to the front of the queue; its prompt and the
tokens it already produced are prefilled again, so nothing it generated is lost. A step that
had to preempt admits no waiting request (it would only take the blocks back).

A request's prefill covers ``num_prefill_tokens`` (its prompt, plus its outputs when it is
re-prefilled after preemption); while ``num_computed_tokens`` (computed or scheduled) is below
that, it is still prefilling. A chunk's blocks are allocated without preempting any request
that already has work in the step (their blocks are in its inputs).

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
from types import MappingProxyType
from typing import Collection, Deque, Dict, List, Mapping, Optional, Tuple

from tpu_executor.core.config import SchedulerConfig
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.lora import AdapterSlots
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.speculative import Drafter, SpecCounts
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, PrefillWork, SampledTokens, SchedulerOutput

# The most steps a request whose drafts keep failing decodes before it drafts again.
MAX_DRAFT_WAIT = 16

# NamedTuple's own constructor is a Python function (~0.5 us); tuple.__new__ builds the same
# record at a third of that, which counts at hundreds of decodes per step.
_new_decode_work = tuple.__new__


class Scheduler:
    """Decides the prefill and decode work of each step and owns the request queues."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 max_chunk_tokens: int, drafter: Optional[Drafter] = None, max_loras: int = 0,
                 max_cpu_loras: Optional[int] = None):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.max_chunk_tokens = max_chunk_tokens  # the largest prefill call (its token bucket)
        self.drafter = drafter
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.num_preemptions = 0
        self.spec = SpecCounts()
        self._verifying: Dict[str, int] = {}  # request id -> drafts in its verify in flight
        # Multi-LoRA: the device's adapter slots (None: the engine serves no adapters).
        self.adapters = AdapterSlots(max_loras, max_cpu_loras) if max_loras else None

    def add(self, request: Request) -> None:
        request.max_outputs = min(request.max_outputs, self.max_model_len - len(request.prompt_token_ids))
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark a request finished (any status) and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
            self._release_adapter(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._verifying.pop(request.request_id, None)
        self.kv_cache.free(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def schedule(self) -> SchedulerOutput:
        """The next step's work: decodes of running requests first, then prefills (chunks of
        running prompts, then new requests) in what is left of the token budget."""
        preemptions = self.num_preemptions
        drafter = self.drafter if self.drafter is not None and self.drafter.active(len(self.running)) else None
        # Only a drafter in the worker reads the names (they go to every worker each step).
        names_drafting = drafter is not None and drafter.drafts_in_worker
        decodes, verifies, prefilling, drafting = self._schedule_decodes(drafter, names_drafting)
        budget = self.config.max_num_batched_tokens - len(decodes) - sum(len(w.token_ids) for w in verifies)
        chunks = self._schedule_chunks(prefilling, budget, decodes, verifies)
        budget -= sum(len(work.token_ids) for work in chunks)
        prefills: List[PrefillWork] = []
        if self.num_preemptions == preemptions:  # blocks are short: admit nobody (as vLLM)
            prefills = self._schedule_prefills(budget, bool(decodes or verifies or chunks))
        if names_drafting:
            drafting.extend(w.request_id for w in chunks + prefills if w.is_last_chunk)
        work = chunks + prefills
        # An empty step is not run: the slots' writes wait for the next one that is.
        loads, reads = (self.adapters.take_loads(), self.adapters.take_reads()) \
            if self.adapters is not None and (work or decodes or verifies) else ((), ())
        return SchedulerOutput(prefills=tuple(work), decodes=tuple(decodes), verifies=tuple(verifies),
                               drafting=tuple(drafting), lora_loads=loads, lora_reads=reads)

    def _schedule_decodes(self, drafter: Optional[Drafter], names_drafting: bool
                          ) -> Tuple[List[DecodeWork], List[PrefillWork], List[Request], List[str]]:
        """A decode for every running request that has finished its prefill, or a verify of
        its drafts (``drafter``: None when no sequence speculates); also the ones still
        prefilling, in admission order (this is the step's one pass over them all), and (when
        ``names_drafting``) the ids of those that may verify drafts in the next step."""
        # Runs over every running request on every step: attributes are read directly rather
        # than through the request's properties, and a request whose blocks have room costs
        # one call into the KV-cache manager.
        decodes: List[DecodeWork] = []
        verifies: List[PrefillWork] = []
        prefilling: List[Request] = []
        drafting: List[str] = []
        # Drafts are extra tokens of the budget, beyond a slot per running sequence.
        spare_tokens = self.config.max_num_batched_tokens - len(self.running)
        table_if_room, block_table = self.kv_cache.table_if_room, self.kv_cache.block_table
        running_status = RequestStatus.RUNNING
        for request in list(self.running):  # a preemption removes requests as it goes
            if request.status is not running_status:
                continue  # preempted by an earlier request's allocation
            if request.num_computed_tokens < request.num_prefill_tokens:
                prefilling.append(request)
                continue
            in_flight, outputs = request.num_in_flight, request.output_token_ids
            num_tokens = len(request.prompt_token_ids) + len(outputs) + in_flight
            if in_flight and self._reaches_limit(request, num_tokens):
                continue  # its in-flight token is its last
            request_id = request.request_id
            if drafter is not None and not in_flight and spare_tokens > 0:
                if request.draft_wait:
                    request.draft_wait -= 1
                else:
                    work = self._verify(request, num_tokens, drafter, spare_tokens)
                    if work is not None:
                        verifies.append(work)
                        if names_drafting:
                            drafting.append(request_id)
                        spare_tokens -= len(work.token_ids) - 1
                        continue
                if names_drafting and not request.draft_wait:
                    drafting.append(request_id)
            table = table_if_room(request_id, num_tokens)
            if table is None:
                if not self._allocate_or_preempt(request, num_tokens):
                    continue  # it was preempted itself
                table = block_table(request_id)
            token_id = PENDING_TOKEN if in_flight else (outputs[-1] if outputs else request.prompt_token_ids[-1])
            work = (request_id, token_id, num_tokens - 1, table, request.sampling, request.lora_slot)
            decodes.append(_new_decode_work(DecodeWork, work))
            request.num_in_flight = in_flight + 1
        return decodes, verifies, prefilling, drafting

    def _verify(self, request: Request, num_tokens: int, drafter: Drafter, spare_tokens: int) -> Optional[PrefillWork]:
        """A verify of the request's drafts (its last token and the drafts, as a prefill from
        the last token's position), with blocks for them; None when it has no drafts or their
        blocks are not free (it then decodes: drafts never preempt a request)."""
        room = min(spare_tokens, request.max_outputs - len(request.output_token_ids) - 1)
        drafts = drafter.propose(request, room) if room > 0 else ()
        if not drafts:
            return None
        if not self.kv_cache.allocate(request.request_id, num_tokens + len(drafts)):
            return None
        request.num_in_flight = 1
        self._verifying[request.request_id] = len(drafts)
        tokens = request.all_token_ids
        return PrefillWork(request.request_id, (tokens[-1], *drafts), num_tokens - 1,
                           self.kv_cache.block_table(request.request_id), request.sampling,
                           lora_slot=request.lora_slot)

    def _allocate_or_preempt(self, request: Request, num_tokens: int, scheduled: Collection[str] = ()) -> bool:
        """Blocks for ``num_tokens`` of a running request, preempting the most recently admitted
        requests (none in ``scheduled``) until they fit; False when the request itself had to go."""
        while not self.kv_cache.allocate(request.request_id, num_tokens):
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _schedule_chunks(self, prefilling: List[Request], budget: int, decodes: List[DecodeWork],
                         verifies: List[PrefillWork]) -> List[PrefillWork]:
        """The next chunk of each request in ``prefilling`` (running, in admission order).
        Blocks come without preempting a request that has work in the step already."""
        chunks: List[PrefillWork] = []
        scheduled = _LazyIds(decodes, verifies, chunks)
        for request in prefilling:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted by an earlier chunk's allocation
            start = request.num_computed_tokens
            num_new = min(request.num_prefill_tokens - start, budget, self.max_chunk_tokens)
            # Blocks full before the previous chunk hold K/V of steps that have finished (the
            # previous chunk's step may still run, or fail): those are safe to share.
            self.kv_cache.cache_computed_blocks(request.request_id, request.all_token_ids, request.last_chunk_start,
                                                request.cache_root)
            if self._allocate_or_preempt(request, start + num_new, scheduled):
                chunks.append(self._chunk(request, num_new))
                budget -= num_new
        return chunks

    def _chunk(self, request: Request, num_new: int) -> PrefillWork:
        """Prefill work for the next ``num_new`` tokens of ``request`` (its blocks allocated)."""
        start = request.num_computed_tokens
        tokens = request.all_token_ids
        request.last_chunk_start = start
        request.num_computed_tokens = start + num_new
        is_last = request.num_computed_tokens == request.num_prefill_tokens
        history = tuple(tokens) if is_last and request.sampling.processing is not None else None
        work = PrefillWork(request.request_id, tuple(tokens[start:start + num_new]), start,
                           self.kv_cache.block_table(request.request_id), request.sampling, is_last, history,
                           prompt_logprob_targets(request, start, start + num_new),
                           None if is_last else tokens[start + num_new], request.lora_slot)
        if is_last:
            request.num_in_flight += 1  # the prompt's sampled token
        return work

    @staticmethod
    def _reaches_limit(request: Request, num_tokens: int) -> bool:
        """Whether a request with ``num_tokens`` (in-flight included) has no token left to make."""
        return num_tokens - len(request.prompt_token_ids) >= request.max_outputs

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_adapter(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _schedule_prefills(self, budget: int, has_work: bool) -> List[PrefillWork]:
        """New requests, in arrival order, while the budget, ``max_num_seqs`` and the free blocks
        allow; one whose adapter finds no free slot, or is still being read, waits, and the ones
        after it go first."""
        prefills: List[PrefillWork] = []
        no_slot: List[Request] = []
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_in_flight:
                break  # preempted with a token still coming: its prefill must include it
            # A new adapter is read while other work runs; with none, now (nothing waits on it).
            if not self._acquire_adapter(request, read_ahead=has_work or bool(prefills)):
                no_slot.append(self.waiting.popleft())
                continue
            work = self._admit(request, budget, bool(prefills) or has_work)
            if work is None:
                self._release_adapter(request)
                break
            budget -= len(work.token_ids)
            prefills.append(work)
        self.waiting.extendleft(reversed(no_slot))
        return prefills

    def _admit(self, request: Request, budget: int, has_work: bool) -> Optional[PrefillWork]:
        """The first prefill of the first waiting request, admitted; None when the budget or
        the free blocks do not allow it (it stays waiting)."""
        tokens = request.all_token_ids
        # A prompt owed log-probs is computed whole: cached blocks would skip its positions.
        owed = request.sampling_params.prompt_logprobs is not None
        cached, num_cached = ([], 0) if owed else self.kv_cache.find_cached_prefix(tokens, request.cache_root)
        num_new = len(tokens) - num_cached
        if self.config.enable_chunked_prefill:
            num_new = min(num_new, budget, self.max_chunk_tokens)
            if num_new <= 0:
                return None
        elif num_new > budget and has_work:
            return None
        if not self.kv_cache.allocate(request.request_id, num_cached + num_new, cached):
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        request.num_prefill_tokens = len(tokens)
        self.running.append(request)
        return self._chunk(request, num_new)

    def _acquire_adapter(self, request: Request, read_ahead: bool = False) -> bool:
        """Give a request about to run its adapter's slot; False when no slot is free for it,
        or (``read_ahead``) when its adapter is not read yet: the workers start reading it."""
        if request.lora_request is None or self.adapters is None:
            return True
        if read_ahead and not self.adapters.is_read(request.lora_request):
            return False
        slot = self.adapters.acquire(request.lora_request)
        if slot is None:
            return False
        request.lora_slot = slot
        return True

    def adapter_failed(self, slot: int, lora_int_id: int, step: SchedulerOutput) -> List[str]:
        """The workers could not write adapter ``lora_int_id`` into ``slot`` for ``step``
        (they left the slot empty): the ids of the requests that must fail, those with work of
        that slot in ``step`` (preempted since or not) and those running in it now (admitted
        since, on the same empty slot), and the slot is emptied (a later request reads the
        adapter again)."""
        doomed = {work.request_id for work in (*step.prefills, *step.decodes, *step.verifies) if work.lora_slot == slot}
        doomed.update(r.request_id for r in self.running if r.lora_slot == slot
                      and r.lora_request is not None and r.lora_request.lora_int_id == lora_int_id)
        self.adapters.failed(slot, lora_int_id)
        return sorted(doomed)

    def _release_adapter(self, request: Request) -> None:
        """A request leaves the running set: its adapter's slot loses a user."""
        if request.lora_slot and self.adapters is not None:
            self.adapters.release(request.lora_slot)
            request.lora_slot = 0

    def update(self, sampled: SampledTokens, requests: Dict[str, Request],
               drafts: Mapping[str, Tuple[int, ...]] = MappingProxyType({})) -> Tuple[SampledTokens, List[Request]]:
        """Record each sampled token and finish the requests it ends: a stop token (EOS unless
        ignored, or one of ``stop_token_ids``), ``max_tokens`` or the end of the context. As in
        vLLM, the scheduler checks these; stop strings need text and are the engine's. A draft
        model's ``drafts`` are kept with their requests for the next step.

        Returns the rows recorded, in order (the token of a request aborted or finished by the
        token before it is discarded; a request preempted while its token was in flight keeps
        it and waits), and the requests finished here.
        """
        dropped, finished = [], []
        kv_cache = self.kv_cache
        running = RequestStatus.RUNNING  # looked up once: reading an enum class attribute is slow
        verified = self._count_verified(sampled.request_ids, requests) if self._verifying else None
        previous = None  # a verify's accepted tokens are consecutive rows of one request
        for row, (request_id, token_id) in enumerate(zip(sampled.request_ids, sampled.token_ids)):
            request = requests.get(request_id)
            if request is None or request.status.is_finished:
                dropped.append(row)
                continue
            if request_id != previous:
                request.num_in_flight -= 1
                previous = request_id
            outputs = request.output_token_ids
            if request.status is running:
                num_computed = request.num_computed_tokens = len(request.prompt_token_ids) + len(outputs)
                if kv_cache.has_blocks_to_cache(request_id, num_computed):
                    kv_cache.cache_computed_blocks(request_id, request.all_token_ids, num_computed, request.cache_root)
            outputs.append(token_id)
            if token_id in request.stop_token_ids:
                if token_id != request.eos_token_id or request.sampling_params.ignore_eos:
                    request.stop_reason = token_id
                self.finish(request, RequestStatus.FINISHED_STOPPED)
                finished.append(request)
            elif len(outputs) >= request.max_outputs:
                self.finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
        if verified:
            self._release_rejected_blocks(verified, requests)
        for request_id, request_drafts in drafts.items():
            request = requests.get(request_id)
            if request is not None:
                request.drafts, request.drafted_at = request_drafts, request.num_tokens
        if dropped:
            sampled = sampled.rows(sorted(set(range(len(sampled))).difference(dropped)))
        return sampled, finished

    def _count_verified(self, request_ids: List[str], requests: Dict[str, Request]) -> List[str]:
        """Count the drafts of the verifies among ``request_ids`` and how many were accepted
        (a verify gives its accepted drafts and one token of the target's); their ids. A request
        whose drafts all failed waits before it drafts again, twice as long after each miss in a
        row (up to ``MAX_DRAFT_WAIT`` steps): where its text does not repeat, a verify costs
        more than the decode it replaces."""
        rows: Dict[str, int] = {}
        for request_id in request_ids:
            if request_id in self._verifying:
                rows[request_id] = rows.get(request_id, 0) + 1
        for request_id, count in rows.items():
            self.spec.add(self._verifying.pop(request_id), count - 1)
            request = requests.get(request_id)
            if request is not None:
                request.draft_misses = 0 if count > 1 else request.draft_misses + 1
                request.draft_wait = min(1 << request.draft_misses, MAX_DRAFT_WAIT + 1) - 1
        return list(rows)

    def _release_rejected_blocks(self, request_ids: List[str], requests: Dict[str, Request]) -> None:
        """Give back the blocks that only rejected drafts reached."""
        for request_id in request_ids:
            request = requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self.kv_cache.shrink(request_id, request.num_tokens)


class _LazyIds:
    """The ids of the work scheduled so far, built only when asked (a preemption while
    allocating a chunk's blocks): most steps never ask."""

    def __init__(self, *works: List):
        self._works = works
        self._ids: set = set()
        self._size = 0

    def __contains__(self, request_id: str) -> bool:
        size = sum(len(items) for items in self._works)
        if size != self._size:  # work was added since the last question
            self._ids = {work.request_id for items in self._works for work in items}
            self._size = size
        return request_id in self._ids


def prompt_logprob_targets(request: Request, start: int, end: int) -> Optional[Tuple[int, ...]]:
    """For a request owed prompt log-probs, per position of the chunk ``[start, end)`` the
    prompt token after it whose log-prob it gives, -1 where none is owed (already given before
    a preemption, or past the prompt); None when the chunk owes none."""
    prompt, owed = request.prompt_token_ids, request.prompt_logprobs_from
    if request.sampling_params.prompt_logprobs is None or owed >= len(prompt) or end < owed:
        return None
    request.prompt_logprobs_from = min(end + 1, len(prompt))
    return tuple(prompt[p + 1] if owed <= p + 1 < len(prompt) else -1 for p in range(start, end))
