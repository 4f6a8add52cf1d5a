"""Many engine replicas behind one OpenAI endpoint, as a Ray Serve application.

Two deployments: ``EngineReplica`` (one engine per replica, each on ``tensor_parallel_size``
chips reserved as placement-group bundles, ranks on one host unless the size needs more) and
``OpenAIIngress``, which serves the very routes of the single-engine server (``build_app``)
over a ``ReplicaPool``: the pool does what ``AsyncLLMEngine`` does for one engine (validates,
queues, streams deltas, aborts) by calling the replicas through a Serve handle whose router is
``routing.PrefixAwareRouter``. Every replica publishes its ``EngineStats`` to a small board
actor each second; ``/metrics`` labels them by replica and ``/health`` counts the replicas that
published lately. Serve replaces a replica whose engine died (its health check fails).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError

from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.request import RequestMetrics, RequestOutput
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.async_engine import QueueFullError
from tpu_executor.engine.llm_engine import EngineDeadError
from tpu_executor.engine.protocols import RequestStream, ServedModel
from tpu_executor.engine.stats import EngineStats
from tpu_executor.entrypoints.openai.config import ServerConfig
from tpu_executor.entrypoints.openai.lora import AdapterRoot
from tpu_executor.executor import WorkerMaker

logger = logging.getLogger(__name__)

PUBLISH_PERIOD_S = 1.0
# A replica that has not published for this long no longer counts as serving.
STALE_AFTER_S = 5.0


@dataclass(frozen=True)
class ReplicaRequest:
    """One engine request sent to a replica (what the router reads: ``token_ids``, ``session``)."""

    request_id: str
    token_ids: List[int]
    params: SamplingParams
    prompt: Optional[str]
    session: Optional[str]
    lora_request: Optional[LoRARequest] = None


class StatsBoard:
    """A Ray actor: the last ``EngineStats`` each replica published, and when it arrived."""

    def __init__(self):
        self.entries: Dict[str, Tuple[EngineStats, bool, float]] = {}

    def publish(self, replica: str, stats: EngineStats, running: bool) -> None:
        self.entries[replica] = (stats, running, time.monotonic())

    def remove(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def snapshot(self, max_age_s: float) -> Dict[str, EngineStats]:
        """The stats of the replicas that published within ``max_age_s`` with a running engine."""
        now = time.monotonic()
        return {r: s for r, (s, running, at) in self.entries.items() if running and now - at <= max_age_s}


BOARD_NAMESPACE = "tpu_executor"


def board_name(app_name: str) -> str:
    return f"tpu_executor_stats_{app_name}"


def _board(app_name: str):
    return ray.remote(StatsBoard).options(name=board_name(app_name), namespace=BOARD_NAMESPACE, get_if_exists=True,
                                          num_cpus=0, lifetime="detached").remote()


class AdapterUnavailable(Exception):
    """A replica cannot serve a request's LoRA adapter: that request fails, the replica serves on."""


class ReplicaAdapters:
    """The adapters a replica reads: the operator's (``lora_modules``, wherever they are) and,
    with runtime updates, those inside the adapter root as this replica's host resolves it (the
    ingress checked the path on its own host; a symlink may differ here)."""

    def __init__(self, server: ServerConfig):
        self.trusted = {path for _, path in server.lora_modules}
        runtime = server.enable_lora_runtime_updates and server.lora_adapter_root is not None
        self.root = AdapterRoot(server.lora_adapter_root) if runtime else None

    def check(self, engine, lora: LoRARequest) -> None:
        """``AdapterUnavailable`` unless ``engine`` may read ``lora`` and it fits the model; the
        reason goes to this replica's log, not to the client (it holds server paths)."""
        try:
            if lora.lora_path not in self.trusted and (self.root is None or not self.root.holds(lora.lora_path)):
                raise ValueError(f"{lora.lora_path!r} is outside the adapter root on this host")
            engine.validate_lora(lora)  # reads once per adapter, then remembered
        except ValueError as err:
            logger.warning("this replica cannot serve LoRA adapter %r: %s", lora.lora_name, err)
            raise AdapterUnavailable(f"the LoRA adapter '{lora.lora_name}' cannot be read on the replica serving "
                                     "this request") from None


class EngineReplica:
    """One Serve replica: an engine on its chips, served through an ``AsyncLLMEngine`` on this
    actor's event loop."""

    async def __init__(self, model_path: str, engine_options: Dict[str, Any], server: ServerConfig,
                       worker_class: Optional[WorkerMaker] = None):
        from tpu_executor.engine.async_engine import AsyncLLMEngine
        from tpu_executor.engine.llm_engine import LLMEngine

        self._publisher: Optional[asyncio.Task] = None
        self.async_engine: Optional[AsyncLLMEngine] = None
        options = {"show_progress": False, **engine_options, "worker_class": worker_class}  # a log is no terminal
        engine = await asyncio.to_thread(lambda: LLMEngine.from_options(model_path, **options))
        self.async_engine = AsyncLLMEngine(engine, max_waiting_requests=server.max_waiting_requests)
        self.async_engine.start()
        self.adapters = ReplicaAdapters(server)
        context = serve.get_replica_context()
        self.name = context.replica_tag
        self.board = _board(context.app_name)
        self._publisher = asyncio.get_running_loop().create_task(self._publish_forever())

    def describe(self) -> Tuple[Any, int]:
        """(the engine's resolved config, vocabulary size): what the ingress checks requests with."""
        engine = self.async_engine.engine
        return engine.config, engine.vocab_size

    async def generate(self, request: ReplicaRequest):
        """The request's deltas; a cancelled call (the client left) aborts it. An adapter this
        replica cannot read fails the request (``AdapterUnavailable``)."""
        if request.lora_request is not None:
            await asyncio.to_thread(self.adapters.check, self.async_engine, request.lora_request)
        async for delta in self.async_engine.generate(request.request_id, request.token_ids, request.params,
                                                      request.prompt, lora_request=request.lora_request):
            yield delta

    async def _publish_forever(self) -> None:
        while True:
            try:
                stats = await self.async_engine.stats()
                await self.board.publish.remote(self.name, stats, self.async_engine.is_running)
            except Exception:  # noqa: BLE001 - a missed publication only ages this replica's entry
                logger.warning("replica %s could not publish its stats", self.name, exc_info=True)
            await asyncio.sleep(PUBLISH_PERIOD_S)

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is replaced."""
        if not self.async_engine.is_running:
            raise RuntimeError(f"the engine of replica {self.name} died: {self.async_engine.dead_reason}")

    async def __del__(self):
        """Serve's graceful shutdown: leave the board, abort what is left, release the workers."""
        if self._publisher is not None:
            self._publisher.cancel()
            await self.board.remove.remote(self.name)
        if self.async_engine is not None:
            await self.async_engine.shutdown()


def in_local_time(metrics: RequestMetrics, arrival_time: float) -> RequestMetrics:
    """A replica's request times moved onto this process's clock (the replica may run on
    another host), taking its arrival as ``arrival_time``: the durations stay the replica's."""
    def moved(moment: Optional[float]) -> Optional[float]:
        return None if moment is None else arrival_time + (moment - metrics.arrival_time)

    return RequestMetrics(arrival_time, moved(metrics.first_scheduled_time), moved(metrics.first_token_time))


class ReplicaPool:
    """The ingress's engine: an ``EngineClient``, like ``AsyncLLMEngine``, over the replicas of a Serve
    deployment. Requests are checked here (with the replicas' config) and streamed from the
    replica the router picks; aborting one cancels its call, which aborts it on the replica."""

    def __init__(self, handle, served: ServedModel, checks, app_name: str, replicas_wanted: int,
                 max_waiting_requests: int):
        self.handle = handle.options(stream=True)
        self.max_waiting_requests = max_waiting_requests
        self.served, self.checks, self.replicas_wanted = served, checks, replicas_wanted
        self.board = _board(app_name)
        self.dead_reason: Optional[str] = None
        self._calls: Dict[str, asyncio.Task] = {}
        self._streams: Dict[str, RequestStream] = {}

    def start(self) -> None:
        """Nothing to start: Serve runs the replicas."""

    @property
    def model(self) -> ServedModel:
        return self.served

    @property
    def is_running(self) -> bool:
        return self.dead_reason is None

    def validate_prompt(self, token_ids: Sequence[int], params: SamplingParams) -> None:
        self.checks.validate(list(token_ids), params)

    def validate_lora(self, lora_request: LoRARequest) -> None:
        self.checks.lora(lora_request)  # every replica reads the adapter when a request first needs it

    def forget_lora(self, lora_request: LoRARequest) -> None:
        self.checks.forget_lora(lora_request.lora_int_id)

    def observe_grammar_compiles(self, observer) -> None:
        self.checks.observe_grammar_compiles(observer)

    def add_request(self, request_id: str, token_ids: Sequence[int], params: SamplingParams,
                    prompt: Optional[str] = None, arrival_time: Optional[float] = None,
                    stream: Optional[RequestStream] = None, session: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Send a validated request to a replica; its deltas go to ``stream``."""
        if not self.is_running:
            raise EngineDeadError(f"the server is not running: {self.dead_reason}")
        stream = stream if stream is not None else RequestStream()
        stream.unfinished.add(request_id)
        self._streams[request_id] = stream
        request = ReplicaRequest(request_id, list(token_ids), params, prompt, session, lora_request)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._calls[request_id] = asyncio.get_running_loop().create_task(self._relay(request, stream, arrival))
        return stream

    async def _relay(self, request: ReplicaRequest, stream: RequestStream, arrival_time: float) -> None:
        try:
            async for delta in self.handle.generate.remote(request):
                if delta.metrics is not None:
                    delta = replace(delta, metrics=in_local_time(delta.metrics, arrival_time))
                stream.put(delta)
        except asyncio.CancelledError:
            raise
        except BackPressureError:
            stream.put(QueueFullError(f"the waiting queue is full (every replica busy and {self.max_waiting_requests} "
                                      "requests waiting for one); retry later"))
        except Exception as err:  # noqa: BLE001 - the replica died or failed: the stream says so
            cause = getattr(err, "cause", None) or err
            if isinstance(cause, AdapterUnavailable):  # this request's failure, not the replica's
                stream.put(RequestOutput(request.request_id, request.prompt, request.token_ids, [], True, str(cause)))
                return
            first_line = next(iter(str(cause).splitlines()), "")  # not the remote traceback
            stream.put(EngineDeadError(f"the replica serving this request failed: {type(cause).__name__}: "
                                       f"{first_line}"))
        finally:
            self._calls.pop(request.request_id, None)
            self._streams.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        call, stream = self._calls.pop(request_id, None), self._streams.pop(request_id, None)
        if stream is not None:
            stream.unfinished.discard(request_id)
        if call is not None:
            call.cancel()

    def abort_stream(self, stream: RequestStream) -> None:
        for request_id in list(stream.unfinished):
            self.abort(request_id)

    async def stats_by_engine(self) -> Dict[str, EngineStats]:
        """Each serving replica's latest stats, by replica."""
        return await self.board.snapshot.remote(STALE_AFTER_S)

    async def health_report(self) -> Dict[str, Any]:
        serving = len(await self.stats_by_engine())
        status = "ok" if serving >= self.replicas_wanted else ("degraded" if serving else "unavailable")
        return {"status": status, "replicas_serving": serving, "replicas_wanted": self.replicas_wanted}

    async def shutdown(self) -> None:
        self.dead_reason = "shut down"
        for request_id in list(self._calls):
            self.abort(request_id)
