"""tpu_executor: a TPU-first LLM inference engine on PyTorch/XLA.

The public names below load on first use, so ``import tpu_executor.core`` (the pure-Python
scheduler, KV-cache manager and sampling parameters) needs neither torch nor the engine.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

_EXPORTS: Dict[str, str] = {
    "LLM": "tpu_executor.entrypoints.llm",
    "LoRARequest": "tpu_executor.core.lora",
    "SamplingParams": "tpu_executor.core.sampling_params",
    "RequestOutputKind": "tpu_executor.core.sampling_params",
    "StructuredOutputsParams": "tpu_executor.core.sampling_params",
    "RequestOutput": "tpu_executor.core.request",
    "CompletionOutput": "tpu_executor.core.request",
    "EngineDeadError": "tpu_executor.engine.core",
    "EngineStats": "tpu_executor.engine.stats",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs (``X as X``: a re-export)
    from tpu_executor.core.lora import LoRARequest as LoRARequest
    from tpu_executor.core.request import CompletionOutput as CompletionOutput
    from tpu_executor.core.request import RequestOutput as RequestOutput
    from tpu_executor.core.sampling_params import RequestOutputKind as RequestOutputKind
    from tpu_executor.core.sampling_params import SamplingParams as SamplingParams
    from tpu_executor.core.sampling_params import StructuredOutputsParams as StructuredOutputsParams
    from tpu_executor.engine.core import EngineDeadError as EngineDeadError
    from tpu_executor.engine.stats import EngineStats as EngineStats
    from tpu_executor.entrypoints.llm import LLM as LLM


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tpu_executor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_EXPORTS))
