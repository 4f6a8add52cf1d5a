"""tpu_executor: a TPU-first LLM inference engine on PyTorch/XLA."""
from tpu_executor.engine import EngineDeadError
from tpu_executor.llm import LLM
from tpu_executor.request import CompletionOutput, RequestOutput
from tpu_executor.sampling_params import SamplingParams

__all__ = ["LLM", "EngineDeadError", "SamplingParams", "RequestOutput", "CompletionOutput"]
