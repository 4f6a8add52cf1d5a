"""The server's own settings (the engine's are the engine options)."""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Optional, Tuple

from tpu_executor.core.config import REASONING_PARSERS  # the parsers of reasoning.py (an engine option too)

# The formats of tool_parsers.py (named here: the config imports nothing of the server).
TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")
ROUTINGS = ("prefix", "least_loaded")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (a name other than localhost may
    resolve to anything, so it counts as not)."""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """Where the server listens and what it lets one client ask for.

    Binds to loopback unless ``host`` says otherwise. ``api_key`` (when set) is required on
    every route but ``/health`` and ``/metrics``, as ``Authorization: Bearer KEY``.
    ``max_waiting_requests`` bounds the queue of requests not yet running (beyond it: 503 at
    once). ``max_body_bytes``, ``max_n`` and ``max_prompts`` cap one request.
    ``allowed_origins`` turns CORS on for those origins.
    ``drain_timeout_s`` is how long SIGTERM lets in-flight requests run before aborting them.
    ``tool_call_parser`` reads tool calls out of a chat output (``tool_parsers.FORMATS``; the
    serve command picks the model family's). ``reasoning_parser`` (``REASONING_PARSERS``) splits a
    chat output into ``reasoning_content`` and ``content``; None leaves it all content.
    ``lora_modules`` are (name, path) of the LoRA adapters served from the start (a request
    names one in ``model``); ``enable_lora_runtime_updates`` opens the load and unload routes,
    which read adapters only inside ``lora_adapter_root`` (required with them; an existing
    directory). On a host other than loopback the load and unload routes need ``api_key``.
    ``trust_request_chat_template`` lets a chat request bring its own ``chat_template`` (vLLM's
    ``--trust-request-chat-template``; refused with a 400 otherwise). Every chat-template render
    stops after ``chat_template_timeout_s`` or once it builds text of more than
    ``max_chat_template_chars`` characters (a 400 either way).
    """

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_waiting_requests: int = 256
    max_body_bytes: int = 4 << 20
    max_n: int = 16
    max_prompts: int = 64
    allowed_origins: Tuple[str, ...] = ()
    drain_timeout_s: float = 30.0
    tool_call_parser: str = "hermes"
    reasoning_parser: Optional[str] = None
    lora_modules: Tuple[Tuple[str, str], ...] = ()
    enable_lora_runtime_updates: bool = False
    lora_adapter_root: Optional[str] = None
    trust_request_chat_template: bool = False
    chat_template_timeout_s: float = 2.0
    max_chat_template_chars: int = 8 << 20

    def __post_init__(self):
        _require(bool(self.model_name), "served model name must not be empty")
        _require(0 <= self.port < 65536, f"port must be in [0, 65535], got {self.port}")
        _require(self.api_key is None or len(self.api_key) > 0, "api_key must not be empty when given")
        for name in ("max_waiting_requests", "max_body_bytes", "max_n", "max_prompts", "max_chat_template_chars"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        _require(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _require(self.chat_template_timeout_s > 0,
                 f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}")
        _require(self.tool_call_parser in TOOL_CALL_FORMATS,
                 f"tool_call_parser must be one of {', '.join(TOOL_CALL_FORMATS)}, got {self.tool_call_parser!r}")
        _require(self.reasoning_parser in (None,) + REASONING_PARSERS,
                 f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        object.__setattr__(self, "lora_modules", tuple(tuple(m) for m in self.lora_modules))
        names = [name for name, _ in self.lora_modules]
        _require(len(set(names)) == len(names) and self.model_name not in names,
                 f"lora_modules names must differ from each other and from the served model name, got {names}")
        self._check_lora_runtime_updates()

    def _check_lora_runtime_updates(self) -> None:
        """The load route reads the server's files for a client: only inside a root the
        operator names, and only for clients holding the key unless the port is loopback's."""
        if self.lora_adapter_root is not None:
            _require(os.path.isdir(self.lora_adapter_root),
                     f"lora_adapter_root {self.lora_adapter_root!r} is not a directory")
            object.__setattr__(self, "lora_adapter_root", os.path.abspath(self.lora_adapter_root))
        if not self.enable_lora_runtime_updates:
            return
        _require(self.lora_adapter_root is not None,
                 "enable_lora_runtime_updates needs lora_adapter_root (--lora-adapter-root DIR): the directory "
                 "that POST /v1/load_lora_adapter may read adapters from")
        _require(self.api_key is not None or is_loopback(self.host),
                 f"runtime LoRA updates on a non-loopback host ({self.host}) need --api-key (api_key): without "
                 "one anybody who reaches the port could load and unload adapters")


@dataclass(frozen=True)
class ReplicaConfig:
    """Engine replicas behind one endpoint (Ray Serve). ``data_parallel_size`` replicas, each
    an engine on ``tensor_parallel_size`` chips; with ``max_replicas`` above it, Serve's
    autoscaler keeps between the two, aiming at ``target_ongoing_requests`` in flight per
    replica. With ``routing`` "prefix" the router sends a request to the replica holding its
    prompt's prefix (or its session: the ``X-Session-Id`` header, else the body's ``user``)
    unless that replica has ``imbalance_limit`` more requests in flight than the least busy
    one; with "least_loaded" every request goes to the least busy replica.
    """

    data_parallel_size: int = 1
    max_replicas: Optional[int] = None
    target_ongoing_requests: int = 16
    imbalance_limit: int = 8
    routing: str = "prefix"
    app_name: str = "tpu_executor"

    def __post_init__(self):
        for name in ("data_parallel_size", "target_ongoing_requests"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        _require(self.imbalance_limit >= 0, f"imbalance_limit must be >= 0, got {self.imbalance_limit}")
        _require(self.max_replicas is None or self.max_replicas >= self.data_parallel_size,
                 f"max_replicas ({self.max_replicas}) must be at least data_parallel_size "
                 f"({self.data_parallel_size}), the autoscaler's minimum")
        _require(self.routing in ROUTINGS, f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        _require(bool(self.app_name), "app_name must not be empty")

    @property
    def replicated(self) -> bool:
        """Whether this is the replicated server (else the single-engine one)."""
        return self.data_parallel_size > 1 or self.max_replicas is not None

    @property
    def autoscales(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.data_parallel_size
