"""``tpu-executor serve``: the OpenAI-compatible server.

    tpu-executor serve                                   # default model on 127.0.0.1:8000
    tpu-executor serve DIR --port 8080 --api-key KEY     # or KEY in $TPU_EXECUTOR_API_KEY
    tpu-executor serve DIR --tensor-parallel-size 8 --ray-address auto --host 0.0.0.0
    tpu-executor serve DIR --data-parallel-size 4 --tensor-parallel-size 2 --ray-address auto

The engine loads and compiles every bucket before the port opens, so a server that answers
``/health`` never compiles again. SIGTERM (or Ctrl-C) stops accepting, lets in-flight requests
finish for ``--drain-timeout`` seconds, aborts the rest and releases the workers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import time
from typing import Dict, Optional

from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args
from tpu_executor.entrypoints.openai.config import ROUTINGS, TOOL_CALL_FORMATS
from tpu_executor.entrypoints.openai.tool_parsers import format_for_family

API_KEY_ENV = "TPU_EXECUTOR_API_KEY"

logger = logging.getLogger(__name__)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("model", nargs="?", help="Hugging Face checkpoint directory (default: SmolLM2-135M-"
                                                 "Instruct, converted once into ~/.cache/tpu_executor)")
    server = parser.add_argument_group("server options")
    server.add_argument("--host", default="127.0.0.1", help="address to bind; the default serves loopback only")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--api-key", default=None, help=f"required as 'Authorization: Bearer KEY' on /v1/* "
                                                        f"(default: ${API_KEY_ENV} if set, else none)")
    server.add_argument("--served-model-name", default=None, help="the model name clients send "
                                                                  "(default: the checkpoint folder's name)")
    server.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests queued but not running; beyond it new requests get 503")
    server.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body")
    server.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt)")
    server.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    server.add_argument("--allowed-origins", nargs="*", default=[], help="CORS origins (default: CORS off)")
    server.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds SIGTERM lets in-flight requests run before aborting them")
    server.add_argument("--tool-call-parser", choices=TOOL_CALL_FORMATS, default=None,
                        help="the format chat tool calls are read in (default: the model family's: llama3_json "
                             "for Llama, mistral for Mistral, hermes for the others)")
    server.add_argument("--lora-modules", nargs="+", default=[], type=lora_module, metavar="NAME=PATH",
                        help="LoRA adapters to serve (with --enable-lora): a request's model field names one")
    server.add_argument("--enable-lora-runtime-updates", action="store_true",
                        help="open POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
                             "--lora-adapter-root, and --api-key unless --host is loopback)")
    server.add_argument("--lora-adapter-root", default=None, metavar="DIR",
                        help="the one directory runtime loads read adapters from: a lora_path outside it "
                             "(symlinks resolved) is refused, a relative one is taken inside it; required by "
                             "--enable-lora-runtime-updates (no default: the server refuses to start without "
                             "it); --lora-modules may lie anywhere")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let chat requests bring their own chat_template (refused by default: a template is "
                             "code the server runs)")
    server.add_argument("--chat-template-timeout", type=float, default=2.0, metavar="SECONDS",
                        help="a chat-template render running longer is stopped (400)")
    server.add_argument("--max-chat-template-chars", type=int, default=8 << 20,
                        help="a chat-template render building longer text is stopped (400)")
    replicas = parser.add_argument_group("replicas (Ray Serve; with --data-parallel-size above 1)")
    replicas.add_argument("--data-parallel-size", type=int, default=1,
                          help="engine replicas behind the one endpoint, each on --tensor-parallel-size chips")
    replicas.add_argument("--max-replicas", type=int, default=None,
                          help="autoscale between --data-parallel-size and this many replicas (default: fixed)")
    replicas.add_argument("--target-ongoing-requests", type=int, default=16,
                          help="the autoscaler's aim: requests in flight per replica")
    replicas.add_argument("--routing", choices=ROUTINGS, default="prefix",
                          help="prefix: a request goes to the replica holding its prompt's prefix or its session "
                               "(X-Session-Id, else `user`); least_loaded: to the least busy replica")
    replicas.add_argument("--imbalance-limit", type=int, default=8,
                          help="requests in flight a replica may have above the least busy one and still "
                               "get the requests whose prefix or session it holds")
    add_engine_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def server_config(args: argparse.Namespace, model_path: str):
    from tpu_executor.entrypoints.openai.config import ServerConfig

    return ServerConfig(
        model_name=args.served_model_name or os.path.basename(os.path.normpath(model_path)),
        host=args.host, port=args.port, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_waiting_requests=args.max_waiting_requests, max_body_bytes=args.max_body_bytes, max_n=args.max_n,
        max_prompts=args.max_prompts, allowed_origins=tuple(args.allowed_origins),
        drain_timeout_s=args.drain_timeout,
        tool_call_parser=args.tool_call_parser or format_for_family(model_family(model_path)),
        # An engine option (grammars start after the reasoning), which the server reads too.
        reasoning_parser=vars(args).get("reasoning_parser"), lora_modules=tuple(args.lora_modules),
        enable_lora_runtime_updates=args.enable_lora_runtime_updates, lora_adapter_root=args.lora_adapter_root,
        trust_request_chat_template=args.trust_request_chat_template,
        chat_template_timeout_s=args.chat_template_timeout, max_chat_template_chars=args.max_chat_template_chars)


def lora_module(text: str):
    """``--lora-modules`` entry ``name=path``."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def replica_config(args: argparse.Namespace):
    from tpu_executor.entrypoints.openai.config import ReplicaConfig

    return ReplicaConfig(data_parallel_size=args.data_parallel_size, max_replicas=args.max_replicas,
                         target_ongoing_requests=args.target_ongoing_requests, imbalance_limit=args.imbalance_limit,
                         routing=args.routing)


def model_family(model_path: str) -> Optional[str]:
    """The checkpoint's ``model_type`` (None when its config.json cannot be read)."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as config:
            return json.load(config).get("model_type")
    except (OSError, ValueError):
        return None


def app_builder(args: Dict[str, str]):
    """``serve run tpu_executor.entrypoints.serve:app_builder model=/ckpt data-parallel-size=4
    ...`` (and a RayService's ``args``): the replicated application, the serve command's flags as
    keys."""
    parser = argparse.ArgumentParser(prog="tpu-executor")
    add_parser(parser.add_subparsers())
    argv = ["serve"] + ([args["model"]] if "model" in args else [])
    for key, value in args.items():
        if key != "model":
            argv += [f"--{key}"] + shlex.split(str(value))
    return application_from_args(parser.parse_args(argv))[0]


def application_from_args(args: argparse.Namespace):
    """(Serve application, server config, replica config) of parsed ``serve`` arguments."""
    from tpu_executor.entrypoints.ray_serve.app import build_application
    from tpu_executor.tools.default_model import prepare

    model_path = args.model or prepare()
    server, replicas = server_config(args, model_path), replica_config(args)
    return build_application(model_path, engine_options_from_args(args), server, replicas), server, replicas


def run(args: argparse.Namespace) -> None:
    if replica_config(args).replicated:
        from tpu_executor.entrypoints.ray_serve.app import run_replicated

        app, server, replicas = application_from_args(args)
        chips = getattr(args, "tensor_parallel_size", None) or 1
        return run_replicated(app, server, replicas, args.ray_address, chips)
    import uvicorn
    from transformers import AutoTokenizer

    from tpu_executor.engine.async_engine import AsyncLLMEngine
    from tpu_executor.engine.llm_engine import LLMEngine
    from tpu_executor.engine.stats import startup_report
    from tpu_executor.entrypoints.openai.api_server import build_app, uvicorn_config
    from tpu_executor.tools.default_model import prepare

    model_path = args.model or prepare()
    config = server_config(args, model_path)  # bad server options fail before the engine starts
    start = time.perf_counter()
    engine = LLMEngine.from_options(model_path, **engine_options_from_args(args))
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=config.max_waiting_requests)
    # The server encodes prompts on its own thread with its own tokenizer; the engine thread
    # keeps the engine's for detokenizing.
    app = build_app(async_engine, AutoTokenizer.from_pretrained(model_path), config)
    print(startup_report(engine.config, engine.stats(), time.perf_counter() - start), flush=True)
    print(f"serving {config.model_name!r} on http://{config.host}:{config.port}/v1", flush=True)
    uvicorn.Server(uvicorn_config(app, config)).run()
