"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine.

Routes follow vLLM's server: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics``, ``/tokenize``, ``/detokenize``. Every error is OpenAI's
``{"error": {message, type, param, code}}``; nothing a client receives ever holds a stack
trace (unexpected errors are logged here and answered with a plain 500).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import threading
import time
from typing import Any, Dict, Iterator, Optional, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tpu_executor.engine.protocols import EngineClient
from tpu_executor.entrypoints.openai.chat import create_chat_completion, render_chat
from tpu_executor.entrypoints.openai.completions import create_completion
from tpu_executor.entrypoints.openai.config import ServerConfig
from tpu_executor.entrypoints.openai.lora import AdapterError
from tpu_executor.entrypoints.openai.metrics import ServerMetrics
from tpu_executor.entrypoints.openai.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
    bad_request,
)
from tpu_executor.entrypoints.openai.serving import OpenAIServing, token_ids

logger = logging.getLogger(__name__)


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class BodyLimit:
    """ASGI middleware: a body over ``limit`` bytes is answered 413 before the app reads it
    (by its Content-Length, or while a chunked body arrives)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = ApiError(413, f"the request body exceeds this server's limit of {self.limit} bytes",
                             type="invalid_request_error", code="request_too_large")
        length = dict(scope.get("headers", ())).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await error_response(too_large)(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge(too_large)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge as err:
            await error_response(err.error)(scope, receive, send)


class _BodyTooLarge(Exception):
    def __init__(self, error: ApiError):
        self.error = error


_TYPE_TAG = re.compile(r"str|int|float|bool|[\w-]*\[.*\]")


def _validation_error(err: RequestValidationError) -> ApiError:
    """pydantic's first complaint, with the field path as ``param``."""
    first = err.errors()[0] if err.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}")
    # A union's members show up in the path as type tags ('str', 'list[int]'); drop them.
    location = [str(part) for part in first.get("loc", ()) if part != "body" and not _TYPE_TAG.fullmatch(str(part))]
    if not location and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return bad_request("the request body must be a JSON object (Content-Type: application/json)")
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return bad_request(f"{param}: {message}" if param else message, param)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError):
        return error_response(_validation_error(err))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        kind = "NotFoundError" if err.status_code == 404 else "invalid_request_error"
        message = str(err.detail)
        if err.status_code == 400:  # FastAPI could not decode the body
            message = f"the body is not valid JSON in UTF-8 ({message})"
        return error_response(ApiError(err.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, err: Exception):
        logger.exception("request failed")
        return error_response(ApiError(500, "internal server error", type="server_error"))


# What a load balancer or a scraper reads without the key; every other route needs it.
OPEN_PATHS = ("/health", "/metrics")


def _install_auth(app: FastAPI, api_key: Optional[str]) -> None:
    if api_key is None:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return error_response(ApiError(401, "Incorrect or missing API key (send Authorization: Bearer "
                                                    "KEY).", type="invalid_request_error", code="invalid_api_key"))
        return await call_next(request)


def _install_drain(app: FastAPI) -> None:
    """Once ``app.state.draining`` is set (the replicated server's SIGTERM), every new request
    gets 503 at once, /health included, while the ones already in flight run on."""
    app.state.draining = False

    @app.middleware("http")
    async def refuse_while_draining(request: Request, call_next):
        if request.app.state.draining:
            return error_response(ApiError(503, "the server is shutting down; send the request elsewhere",
                                           type="server_error", code="shutting_down"))
        return await call_next(request)


def build_app(engine: EngineClient, tokenizer, config: ServerConfig, collectors: Sequence[Any] = ()) -> FastAPI:
    """The FastAPI app; the engine thread starts with the app and the workers stop with it.
    ``engine`` is one async engine, or a ``ReplicaPool`` of several (``EngineClient``);
    ``collectors`` add their metrics to ``/metrics``."""
    metrics = ServerMetrics(collectors)
    engine.observe_grammar_compiles(metrics.grammar_compile.observe)
    serving = OpenAIServing(engine, tokenizer, config, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            logger.info("stopping the engine")
            await engine.shutdown()

    # strict_content_type=False: a JSON body without a Content-Type header is still read.
    app = FastAPI(title="tpu_executor", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  strict_content_type=False)
    app.state.serving = serving
    _install_error_handlers(app)
    _install_auth(app, config.api_key)
    _install_drain(app)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    _add_routes(app, serving)
    return app


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    config, engine = serving.config, serving.engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await create_chat_completion(serving, body, request)

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        """vLLM's model cards, ``root`` the served name rather than a path: a client learns
        nothing of the server's files."""
        now = int(time.time())
        base = {"id": config.model_name, "object": "model", "created": now, "owned_by": "tpu_executor",
                "root": config.model_name, "max_model_len": serving.max_model_len}
        adapters = [{"id": a.lora_name, "object": "model", "created": now, "owned_by": "tpu_executor",
                     "root": a.lora_name, "parent": config.model_name, "max_model_len": serving.max_model_len}
                    for a in serving.adapters.all()]
        return {"object": "list", "data": [base, *adapters]}

    if config.enable_lora_runtime_updates:
        _add_lora_routes(app, serving)

    @app.get("/health")
    async def health():
        """200 while the engine runs; with replicas, 200 and how many serve (``degraded``
        below the wanted count), 503 when none does."""
        if not engine.is_running:
            return error_response(ApiError(503, f"the engine is not running: {engine.dead_reason}",
                                           type="server_error", code="engine_unavailable"))
        report = await engine.health_report()
        if report["status"] == "unavailable":
            return error_response(ApiError(503, "no engine replica is serving", type="server_error",
                                           code="engine_unavailable"))
        return JSONResponse(report)

    @app.get("/metrics")
    async def metrics_page():
        return Response(serving.metrics.render(await engine.stats_by_engine()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            body.check_template_fields()
            tokens = (await render_chat(serving, body, body.messages)).token_ids
        else:
            tokens = token_ids(serving.tokenizer, body.prompt, "prompt", body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": serving.max_model_len, "tokens": list(tokens)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        vocab = engine.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens holds ids outside the vocabulary [0, {vocab}): {bad[:8]}", "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}


def _add_lora_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """vLLM's routes to load and unload LoRA adapters at run time (``--enable-lora-runtime-updates``):
    a load reads only inside ``--lora-adapter-root`` (``ServedAdapters.load``)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        try:  # reads the adapter's config and weight header: off the event loop
            await asyncio.to_thread(serving.adapters.load, body.lora_name, body.lora_path)
        except AdapterError as err:
            raise bad_request(str(err), err.param) from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        try:
            serving.adapters.remove(body.lora_name)
        except KeyError:
            raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name",
                           "NotFoundError") from None
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings: SIGTERM stops accepting, drains for ``drain_timeout_s``, then the
    lifespan's end aborts what is left and releases the workers."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          timeout_graceful_shutdown=config.drain_timeout_s, access_log=False)


@contextlib.contextmanager
def serve_in_thread(engine: EngineClient, tokenizer, config: ServerConfig) -> Iterator[str]:
    """Run the server on a thread of this process (benchmarks, tests); yields its base URL
    (``config.port`` 0 picks a free port). Leaving stops it and shuts the engine down."""
    server = uvicorn.Server(uvicorn_config(build_app(engine, tokenizer, config), config))
    thread = threading.Thread(target=server.run, name="http-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start on {config.host}:{config.port}")
        time.sleep(0.02)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=config.drain_timeout_s + 60)
