"""What the completions and chat endpoints share: checking a request against the served model
and the server's limits, encoding prompts, starting engine requests, and reading their deltas
either whole (abort on client disconnect) or as server-sent events (errors in band).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Optional, Sequence, Union

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HttpRequest

from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.request import RequestOutput, accumulate_deltas
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.async_engine import QueueFullError
from tpu_executor.engine.llm_engine import EngineDeadError
from tpu_executor.engine.protocols import EngineClient, RequestStream
from tpu_executor.entrypoints.openai.config import ServerConfig
from tpu_executor.entrypoints.openai.lora import ServedAdapters
from tpu_executor.entrypoints.openai.metrics import RequestTracker, ServerMetrics
from tpu_executor.entrypoints.openai.protocol import ApiError, bad_request, checked_text, field_named_by
from tpu_executor.entrypoints.openai.templates import ChatTemplates

logger = logging.getLogger(__name__)

ChunkMaker = Callable[[int, RequestOutput], Iterable[Dict[str, Any]]]


@dataclass
class Prompt:
    """One prompt, encoded: its text (None when it came as token ids) and token ids."""

    text: Optional[str]
    token_ids: List[int]


@dataclass
class Started:
    """The engine requests of one HTTP request: their ids in prompt order, one shared stream."""

    request_ids: List[str]
    stream: RequestStream
    trackers: Dict[str, RequestTracker]

    def __post_init__(self):
        self._index = {request_id: i for i, request_id in enumerate(self.request_ids)}

    def index_of(self, request_id: str) -> int:
        return self._index[request_id]


def engine_unavailable(reason: str) -> ApiError:
    return ApiError(503, f"the engine is not available: {reason}", type="server_error", code="engine_unavailable")


def queue_full(err: QueueFullError) -> ApiError:
    return ApiError(503, str(err), type="server_error", code="queue_full")


def engine_failure(message: str) -> ApiError:
    """A request the engine failed: a 400 naming the field when the request's own fields
    doomed it (the message starts with one), else a 500."""
    field = field_named_by(message, None)
    if field is not None:
        return bad_request(message, field)
    return ApiError(500, f"the engine failed this request: {message}", type="server_error")


def sse(payload: Union[str, Dict[str, Any]]) -> str:
    """One server-sent event in OpenAI's framing."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class OpenAIServing:
    """Shared machinery of the generation endpoints over one async engine."""

    def __init__(self, engine: EngineClient, tokenizer, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.max_model_len = engine.model.max_model_len
        self.adapters = ServedAdapters(engine, config.model_name, config.lora_modules, config.lora_adapter_root)
        self.templates = ChatTemplates(tokenizer, config.chat_template_timeout_s, config.max_chat_template_chars)

    # ---- checks -------------------------------------------------------------------------
    def check_model(self, name: Optional[str]) -> Optional[LoRARequest]:
        """The LoRA adapter that the ``model`` field names (None: the base model); a 404 in
        OpenAI's shape for a name this server does not serve."""
        if name is None or name == self.config.model_name:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            served = ", ".join(f"`{n}`" for n in [self.config.model_name] + [a.lora_name for a in self.adapters.all()])
            raise ApiError(404, f"The model `{name}` does not exist (this server serves {served}).", "model",
                           "NotFoundError", "model_not_found")
        return adapter

    def check_request(self, body, endpoint: str) -> Optional[LoRARequest]:
        """Model, supported fields, caps; logs unknown fields (accepted, ignored). Returns the
        LoRA adapter the request runs with (None: the base model)."""
        adapter = self.check_model(body.model)
        body.check_supported()
        if body.n > self.config.max_n:
            raise bad_request(f"n is {body.n} but this server allows at most {self.config.max_n}", "n")
        unknown = body.unknown_fields()
        if unknown:
            logger.info("%s: ignoring unknown fields %s", endpoint, unknown)
        if not self.engine.is_running:
            raise engine_unavailable(self.engine.dead_reason or "shutting down")
        return adapter

    def encode(self, prompt: Union[str, List[int]], param: str, add_special_tokens: bool = True) -> Prompt:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt must not be empty", param)
            return Prompt(prompt, token_ids(self.tokenizer, prompt, param, add_special_tokens))
        if not prompt:
            raise bad_request("prompt token ids must not be empty", param)
        return Prompt(None, list(prompt))

    def max_tokens_for(self, prompt: Prompt, requested: Optional[int], param: str = "max_tokens") -> int:
        """``requested`` if prompt + output fit the context, else a 400 clients can parse;
        ``None`` means whatever fits."""
        room = self.max_model_len - len(prompt.token_ids)
        if room < 1 or (requested is not None and requested > room):
            asked = len(prompt.token_ids) + (requested or 0)
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {asked} tokens ({len(prompt.token_ids)} in the prompt, "
                                f"{requested or 0} for the completion). Please reduce the length of the "
                                "prompt or the completion.", param, code="context_length_exceeded")
        return room if requested is None else requested

    async def validate(self, prompt: Prompt, params: SamplingParams, param: str,
                       grammar_field: str = "structured_outputs") -> None:
        """The engine's checks of a prompt and its parameters; the 400 names the field the
        message starts with (``logit_bias``, ``bad_words``...; a grammar's error names
        ``grammar_field``), else ``param``. A grammar compiles on a thread, off the event loop."""
        try:
            if params.structured_outputs is None:
                self.engine.validate_prompt(prompt.token_ids, params)
            else:
                await asyncio.to_thread(self.engine.validate_prompt, prompt.token_ids, params)
        except ValueError as err:
            field = field_named_by(str(err), param)
            raise bad_request(str(err), grammar_field if field == "structured_outputs" else field) from None

    # ---- running ------------------------------------------------------------------------
    def start(self, kind: str, prompts: Sequence[Prompt], params: Sequence[SamplingParams],
              features: Sequence[str] = (), session: Optional[str] = None,
              client_id: Optional[str] = None, adapter: Optional[LoRARequest] = None) -> Started:
        """Queue one engine request per prompt on one stream; all or none are queued.
        ``features``: what the request uses beyond its sampling parameters (metrics);
        ``session``: the client's session, which a replicated server keeps on one replica;
        ``client_id``: the request's own ``request_id`` (vLLM's field), else a random one;
        ``adapter``: the LoRA adapter the requests run with."""
        base = f"{kind}-{client_id or uuid.uuid4().hex}"
        ids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        arrival, stream = time.monotonic(), RequestStream()
        trackers = {}
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                self.engine.add_request(request_id, prompt.token_ids, p, prompt.text, arrival, stream, session,
                                        lora_request=adapter)
                trackers[request_id] = self.metrics.tracker(len(prompt.token_ids), arrival, p, features,
                                                            adapter.lora_name if adapter is not None else None)
        except QueueFullError as err:
            self.engine.abort_stream(stream)
            raise queue_full(err) from None
        except EngineDeadError as err:
            self.engine.abort_stream(stream)
            raise engine_unavailable(str(err)) from None
        except ValueError as err:  # a request_id of a request still running
            self.engine.abort_stream(stream)
            raise bad_request(str(err), "request_id") from None
        return Started(ids, stream, trackers)

    async def respond(self, started: Started, builder, stream: bool, http: HttpRequest):
        """The HTTP response: server-sent events built by ``builder.chunks`` and
        ``builder.final_chunks``, or one JSON body from ``builder.whole``."""
        if stream:
            return StreamingResponse(self.stream_events(started, builder.chunks, builder.final_chunks),
                                     media_type="text/event-stream")
        return JSONResponse(builder.whole(await self.collect(started, http)))

    async def _read(self, started: Started) -> AsyncIterator[RequestOutput]:
        async for delta in started.stream:
            started.trackers[delta.request_id].observe(delta)
            yield delta

    async def collect(self, started: Started, http: HttpRequest) -> List[RequestOutput]:
        """Every request's whole output, in prompt order; a client that disconnects first
        aborts them (their blocks are freed before the next step)."""
        async def gather() -> Dict[str, RequestOutput]:
            return accumulate_deltas([delta async for delta in self._read(started)])

        work = asyncio.ensure_future(gather())
        gone = asyncio.ensure_future(wait_for_disconnect(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                self.engine.abort_stream(started.stream)
        if not work.done() or work.cancelled():
            raise asyncio.CancelledError("client disconnected")
        try:
            totals = work.result()
        except QueueFullError as err:  # a replicated server learns it after the request was sent
            raise queue_full(err) from None
        except EngineDeadError as err:
            raise engine_unavailable(str(err)) from None
        outputs = [totals[i] for i in started.request_ids]
        failed = next((o.error for o in outputs if o.error), None)
        if failed:
            raise engine_failure(failed)
        return outputs

    async def stream_events(self, started: Started, chunks: ChunkMaker,
                            final_chunks: Callable[[], Iterable[Dict[str, Any]]]) -> AsyncIterator[str]:
        """Server-sent events: ``chunks(prompt_index, delta)`` per delta, then ``final_chunks()``,
        then ``[DONE]``. An error after the first byte goes out in band. A client that goes
        away closes this generator, which aborts what is left."""
        try:
            async for delta in self._read(started):
                if delta.error:
                    raise engine_failure(delta.error)
                for chunk in chunks(started.index_of(delta.request_id), delta):
                    yield sse(chunk)
            for chunk in final_chunks():
                yield sse(chunk)
        except ApiError as err:
            yield sse(err.body())
        except QueueFullError as err:
            yield sse(queue_full(err).body())
        except EngineDeadError as err:
            yield sse(engine_unavailable(str(err)).body())
        except Exception:  # noqa: BLE001 - the client gets a message, the log gets the trace
            logger.exception("streaming a response failed")
            yield sse(ApiError(500, "internal server error", type="server_error").body())
        finally:
            self.engine.abort_stream(started.stream)
        yield sse("[DONE]")


def session_of(body, http: HttpRequest) -> Optional[str]:
    """The client's session: the ``X-Session-Id`` header, else the body's ``session_id`` (vLLM's
    field), else its ``user``."""
    return http.headers.get("x-session-id") or getattr(body, "session_id", None) or getattr(body, "user", None)


async def wait_for_disconnect(http: HttpRequest) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def usage(prompts: Sequence[Prompt], outputs_tokens: int) -> Dict[str, int]:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": outputs_tokens,
            "total_tokens": prompt_tokens + outputs_tokens}


def token_ids(tokenizer, text: str, param: str, add_special_tokens: bool = True) -> List[int]:
    """``text`` encoded; text the tokenizer cannot take is a 400 naming ``param``."""
    try:
        return list(tokenizer(checked_text(text, param), add_special_tokens=add_special_tokens)["input_ids"])
    except (TypeError, ValueError) as err:
        raise bad_request(f"the tokenizer cannot encode {param}: {err}", param) from None


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def vllm_prompt_logprobs(tokenizer, output: RequestOutput, width: int) -> List[Optional[Dict[str, Dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) the token and its
    ``width`` most likely alternatives as ``{token id: {logprob, rank, decoded_token}}``."""
    result = []
    for position, entries in enumerate(output.prompt_logprobs):
        if entries is None:
            result.append(None)
            continue
        token = output.prompt_token_ids[position]
        ranked = sorted((t for t in entries if t != token), key=lambda t: -entries[t])[:width]
        ranks = {token: output.prompt_logprob_ranks[position], **{t: r + 1 for r, t in enumerate(ranked)}}
        result.append({str(t): {"logprob": entries[t], "rank": ranks[t], "decoded_token": token_text(tokenizer, t)}
                       for t in ranks})
    return result
