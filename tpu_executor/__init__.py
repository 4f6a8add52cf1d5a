"""tpu_executor: a TPU-first LLM inference engine on PyTorch/XLA."""
from tpu_executor.core.request import CompletionOutput, RequestOutput
from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams
from tpu_executor.engine.llm_engine import EngineDeadError
from tpu_executor.engine.stats import EngineStats
from tpu_executor.entrypoints.llm import LLM

__all__ = ["LLM", "EngineDeadError", "EngineStats", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput"]
