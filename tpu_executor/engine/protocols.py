"""The engine's two plug points, as protocols: what the OpenAI server drives (``EngineClient``:
one ``AsyncLLMEngine``, or the replicated server's ``ReplicaPool``; with the stream and model
facts it hands out) and what the front-end drives (``CoreClient``: an ``EngineCore`` in this
process, or a ``CoreProcess``)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Protocol, Sequence, Set, Union, runtime_checkable

from tpu_executor.core.config import EngineConfig
from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.request import Request, RequestOutput, RequestStatus
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.core import CoreOutput
from tpu_executor.engine.stats import EngineStats


@dataclass(frozen=True)
class ServedModel:
    """What a server reads of the engine's model: fixed once the engine has started."""

    path: str  # the checkpoint directory
    max_model_len: int  # as served (a default one fitted to the KV cache)
    vocab_size: int


class RequestStream:
    """The deltas of one or more engine requests, in the order the engine produced them (a
    completions call with several prompts reads all of them from one stream). It ends after
    the finished delta of its last request, or raises the error that ended it
    (``EngineDeadError`` when the engine died)."""

    def __init__(self):
        self.unfinished: Set[str] = set()
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def put(self, item: Union[RequestOutput, BaseException]) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return item


@runtime_checkable
class EngineClient(Protocol):
    """What the OpenAI server needs of the engine behind it. Requests are validated first
    (``validate_prompt``), then added; their deltas arrive on the returned stream."""

    dead_reason: Optional[str]

    @property
    def model(self) -> ServedModel:
        """The served model's fixed facts (path, context length, vocabulary)."""

    @property
    def is_running(self) -> bool:
        """Whether requests can be added."""

    def start(self) -> None:
        """Start serving (called on the event loop that reads the streams)."""

    async def shutdown(self) -> None:
        """Abort what is left and release the engines."""

    def validate_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """``ValueError`` naming what is wrong with a request, before it is queued."""

    def observe_grammar_compiles(self, observer: Callable[[float], None]) -> None:
        """Call ``observer(seconds)`` after each grammar compilation."""

    def add_request(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    prompt: Optional[str] = None, arrival_time: Optional[float] = None,
                    stream: Optional[RequestStream] = None, session: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Queue a validated request; its deltas go to the returned stream (``stream`` if
        given). ``session`` routes it among replicas; ``lora_request`` is its adapter."""

    def validate_lora(self, lora_request: LoRARequest) -> None:
        """``ValueError`` naming what is wrong with an adapter, before a request uses it."""

    def forget_lora(self, lora_request: LoRARequest) -> None:
        """The adapter was unloaded (its id names no adapter any more)."""

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort every unfinished request of ``stream`` (its reader has gone)."""

    async def stats_by_engine(self) -> Dict[str, EngineStats]:
        """Each serving engine's stats by name: a replica's name, or ``""`` for a lone engine."""

    async def health_report(self) -> Dict[str, Any]:
        """``/health``'s answer while running: ``status`` is ``ok``, ``degraded`` (fewer
        replicas than wanted) or ``unavailable`` (none serves), with any counts."""


@runtime_checkable
class CoreClient(Protocol):
    """What the front-end (``LLMEngine``) drives: the scheduler, KV cache and executor behind
    one step call, in this process or in a process of its own."""

    config: EngineConfig
    vocab_size: int
    dead_reason: Optional[str]

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet scheduled."""

    def add(self, samples: Sequence[Request]) -> None:
        """Queue the samples of one request."""

    def finish(self, sample_ids: Sequence[str], status: RequestStatus) -> None:
        """End these samples (stopped by the front-end, or aborted); their blocks are freed."""

    def use_grammars(self, compiler) -> None:
        """Constrain requests with grammars through ``compiler``."""

    def forget_lora(self, lora_int_id: int) -> None:
        """Unload adapter ``lora_int_id``: its slot is emptied once no running request uses it."""

    def has_sample(self, sample_id: str) -> bool:
        """Whether the core still holds this sample."""

    def has_unfinished(self) -> bool:
        """Whether any sample is queued, running or has tokens still to report."""

    def step(self) -> CoreOutput:
        """Schedule and run one step; its sampled tokens and finished samples."""

    def stats(self) -> EngineStats:
        """The engine's figures now."""

    def shutdown(self) -> None:
        """Stop the workers and release their devices."""
