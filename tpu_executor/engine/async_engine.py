"""The async engine: one thread owns an ``LLMEngine`` and steps it while work exists; asyncio
code submits requests through a thread-safe command queue and reads each request's deltas
from an async stream.

The engine thread is the only one that touches the engine (scheduler, KV cache, executor), so
nothing in it needs a lock; the event loop only sees deltas, which the thread hands over with
one ``call_soon_threadsafe`` per step. A model step blocks its thread for its whole duration
(the device, or XLA's CPU backend, releases the GIL), while the event loop goes on accepting
and streaming. With ``core_process`` the engine's core steps in a process of its own and this
thread only turns its outputs into deltas, waiting on a pipe (without the GIL) in between.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Dict, List, Optional, Sequence

from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.request import RequestOutput
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.llm_engine import EngineDeadError, LLMEngine
from tpu_executor.engine.protocols import RequestStream, ServedModel
from tpu_executor.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue holds ``max_waiting_requests`` already; the request was not queued."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Optional[str]
    token_ids: List[int]
    params: SamplingParams
    arrival_time: float
    lora_request: Optional[LoRARequest] = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ForgetLoRA:
    lora_int_id: int


@dataclass(frozen=True)
class _Stats:
    answer: concurrent.futures.Future


_STOP = object()


class AsyncLLMEngine:
    """Runs ``engine`` on a thread of its own and serves it to asyncio code.

    ``max_waiting_requests`` bounds the requests queued but not yet running: one more raises
    ``QueueFullError`` at once instead of waiting unseen. Call ``start()`` from the event loop
    that will read the streams, and ``await shutdown()`` at the end.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024):
        if max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.dead_reason: Optional[str] = engine.dead_reason
        self._commands: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._streams: Dict[str, RequestStream] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        # Admission: requests the engine has queued, plus adds still in the command queue.
        self._lock = threading.Lock()
        self._engine_waiting = 0
        self._unapplied_adds = 0

    def start(self) -> None:
        """Start the engine thread; deltas are delivered on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def model(self) -> ServedModel:
        """The served model's fixed facts; the one view a server has of the engine's state."""
        config = self.engine.config
        return ServedModel(config.model.model, config.max_model_len, self.engine.vocab_size)

    def validate_lora(self, lora_request: LoRARequest) -> None:
        """``ValueError`` naming what is wrong with an adapter (reads its config and its weight
        file's header; any thread may call it)."""
        self.engine.checks.lora(lora_request)

    def forget_lora(self, lora_request: LoRARequest) -> None:
        """The adapter was unloaded: the engine no longer takes its id as checked, and its
        device slot is emptied once the requests running with it end."""
        self.engine.checks.forget_lora(lora_request.lora_int_id)
        self._commands.put(_ForgetLoRA(lora_request.lora_int_id))

    def validate_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        """``ValueError`` naming what is wrong with a prompt, before it is queued (reads only
        the engine's fixed limits, so any thread may call it)."""
        self.engine.validate_prompt(token_ids, params)

    def observe_grammar_compiles(self, observer) -> None:
        """Call ``observer(seconds)`` after each grammar compilation (a server's metric)."""
        self.engine.checks.observe_grammar_compiles(observer)

    @property
    def is_running(self) -> bool:
        return self.dead_reason is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_open_requests(self) -> int:
        """Requests whose stream has not ended yet."""
        return len(self._streams)

    # ---- the event loop's side ----------------------------------------------------------
    def add_request(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    prompt: Optional[str] = None, arrival_time: Optional[float] = None,
                    stream: Optional[RequestStream] = None, session: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Queue a validated request (see ``LLMEngine.validate_prompt``, ``validate_lora``);
        returns the stream its deltas go to (``stream`` if given, to share one among several
        requests); ``lora_request``: its LoRA adapter (None: the base model).
        ``session`` is a routing hint for replicated servers; one engine has nothing to route. Raises
        ``EngineDeadError`` if the engine is gone, ``QueueFullError`` if the waiting queue is
        full, ``ValueError`` for an id already in use."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason or 'not started or shut down'}")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        with self._lock:
            if self._engine_waiting + self._unapplied_adds >= self.max_waiting_requests:
                raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests); "
                                     "retry later")
            self._unapplied_adds += 1
        stream = stream if stream is not None else RequestStream()
        stream.unfinished.add(request_id)
        self._streams[request_id] = stream
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(_Add(request_id, prompt, list(token_ids), params, arrival, lora_request))
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed before the next step. Its stream gets no more
        deltas of it."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.unfinished.discard(request_id)
            self._commands.put(_Abort(request_id))

    def abort_stream(self, stream: RequestStream) -> None:
        """Abort every unfinished request of ``stream`` (its reader has gone)."""
        for request_id in list(stream.unfinished):
            self.abort(request_id)

    async def generate(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                       prompt: Optional[str] = None, arrival_time: Optional[float] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """The deltas of one request. Leaving the loop early (a client disconnect cancels the
        task) aborts the request."""
        stream = self.add_request(request_id, token_ids, params, prompt, arrival_time, lora_request=lora_request)
        try:
            async for delta in stream:
                yield delta
        finally:
            self.abort_stream(stream)

    async def stats(self) -> EngineStats:
        """A fresh ``EngineStats``, taken by the engine thread between two steps."""
        if not self.is_running:
            return self.engine.stats()
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Stats(answer))
        return await asyncio.wrap_future(answer)

    async def stats_by_engine(self) -> Dict[str, EngineStats]:
        """``stats()`` under the name of a lone engine, ``""`` (``EngineClient``)."""
        return {"": await self.stats()}

    async def health_report(self) -> Dict[str, str]:
        """``/health``'s answer while the engine runs."""
        return {"status": "ok"}

    async def shutdown(self) -> None:
        """Abort what is left, stop the engine thread and release the workers."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(self._thread.join)
        self._end_all_streams(EngineDeadError("the server is shutting down"))
        self.dead_reason = self.dead_reason or "shut down"
        await asyncio.to_thread(self.engine.shutdown)

    # ---- delivery (runs on the event loop) -----------------------------------------------
    def _dispatch(self, deltas: List[RequestOutput]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue  # aborted by its reader
            stream.put(delta)
            if delta.finished:
                del self._streams[delta.request_id]

    def _end_all_streams(self, error: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.put(error)
        self._streams.clear()

    def _die(self, reason: str, last_deltas: List[RequestOutput]) -> None:
        self.dead_reason = reason
        self._dispatch(last_deltas)
        self._end_all_streams(EngineDeadError(f"the engine died: {reason}"))

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while self._apply_commands(block=not engine.has_unfinished_requests()):
                if engine.has_unfinished_requests():
                    deltas = engine.step()
                    self._publish_waiting()
                    self._loop.call_soon_threadsafe(self._dispatch, deltas)
        except EngineDeadError as err:
            self._loop.call_soon_threadsafe(self._die, str(err), err.outputs)
        except BaseException as err:  # noqa: BLE001 - a bug in the loop: nothing can step any more
            logger.exception("the engine loop failed")
            self._loop.call_soon_threadsafe(self._die, f"{type(err).__name__}: {err}", [])
            engine.shutdown()
        finally:
            self._answer_left_over_stats()

    def _answer_left_over_stats(self) -> None:
        """Stats asked for while the loop was ending still get an answer."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Stats):
                try:
                    command.answer.set_result(self.engine.stats())
                except Exception as err:  # noqa: BLE001 - the workers are gone
                    command.answer.set_exception(err)

    def _apply_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if ``block``); False on stop."""
        while True:
            try:
                command = self._commands.get(timeout=None) if block else self._commands.get_nowait()
            except queue.Empty:
                self._publish_waiting()
                return True
            block = False
            if command is _STOP:
                self.engine.abort_all_requests()
                return False
            self._apply(command)

    def _apply(self, command: object) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            with self._lock:
                self._unapplied_adds -= 1
            try:
                engine.add_request(command.prompt, command.params, command.request_id,
                                   prompt_token_ids=command.token_ids, arrival_time=command.arrival_time,
                                   lora_request=command.lora_request)
            except ValueError as err:  # a race the caller's checks could not see; fail only this one
                self._loop.call_soon_threadsafe(self._fail_stream, command.request_id, err)
        elif isinstance(command, _Abort):
            engine.abort_request(command.request_id)
        elif isinstance(command, _ForgetLoRA):
            engine.forget_lora(command.lora_int_id)
        elif isinstance(command, _Stats):
            command.answer.set_result(engine.stats())

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self.abort_stream(stream)  # the stream's other requests go with it
            stream.put(error)

    def _publish_waiting(self) -> None:
        with self._lock:
            self._engine_waiting = self.engine.num_waiting
