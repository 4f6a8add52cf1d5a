"""Offline entry point: ``LLM(model=..., device=...).generate(prompts, params)``."""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

from tqdm import tqdm

from models.layers.parallel import check_tensor_parallel
from tpu_executor.config import (CacheConfig, CompileConfig, DeviceConfig, EngineConfig, ModelConfig,
                                 ParallelConfig, SchedulerConfig, resolve_max_model_len)
from tpu_executor.engine import LLMEngine, PromptType
from tpu_executor.model_loader import checkpoint_limit, load_hf_config
from tpu_executor.request import RequestOutput
from tpu_executor.sampling_params import SamplingParams

_SECTIONS = (CacheConfig, SchedulerConfig, CompileConfig, ParallelConfig)


def build_engine_config(model: str, device: str = "xla", dtype: str = "float32",
                        max_model_len: Optional[int] = None, seed: int = 0,
                        quantization: Optional[str] = None, **options) -> EngineConfig:
    """An EngineConfig from flat keyword options (each goes to the config that has the field)."""
    model_config = ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                               quantization=quantization)
    sections = {}
    for cls in _SECTIONS:
        fields = set(cls.__dataclass_fields__)
        sections[cls] = cls(**{k: options.pop(k) for k in list(options) if k in fields})
    if options:
        raise ValueError(f"unknown engine options: {sorted(options)}")
    compile_config = sections[CompileConfig]
    hf_config = load_hf_config(model)
    # An impossible split fails here, before any worker starts.
    check_tensor_parallel(hf_config, sections[ParallelConfig].tensor_parallel_size)
    limit = resolve_max_model_len(checkpoint_limit(hf_config), max_model_len, compile_config.prefill_buckets)
    return EngineConfig(model=model_config, cache=sections[CacheConfig],
                        scheduler=sections[SchedulerConfig], compile=compile_config,
                        device=DeviceConfig(device), max_model_len=limit, parallel=sections[ParallelConfig])


class LLM:
    """Offline batched generation, shaped like vLLM's ``LLM``.

    Extra keyword options go to the config that owns them, e.g. ``block_size=16``,
    ``max_num_seqs=8``, ``prefill_buckets=(64, 128)``, ``strict=True``,
    ``tensor_parallel_size=4``, ``ray_address="auto"``. ``quantization="int8"`` serves INT8
    weight-only (W8A16) linears and experts.
    """

    def __init__(self, model: str, device: str = "xla", dtype: str = "float32",
                 max_model_len: Optional[int] = None, seed: int = 0, show_progress: bool = True,
                 quantization: Optional[str] = None, **options):
        from transformers import AutoTokenizer

        config = build_engine_config(model, device, dtype, max_model_len, seed, quantization, **options)
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = LLMEngine(config, tokenizer, show_progress=show_progress)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the workers (Ray actors release their chips)."""
        self.engine.shutdown()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True) -> List[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        All prompts are validated before any is queued, so a bad one raises ValueError and
        leaves the engine as it was.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        token_ids = [self.engine.prepare_prompt(prompt, p) for prompt, p in zip(prompts, params)]
        ids = [self.engine.add_request(prompt, p, prompt_token_ids=t)
               for prompt, p, t in zip(prompts, params, token_ids)]
        return self._run(ids, use_tqdm)

    def _run(self, ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        done = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for output in self.engine.step():
                    done[output.request_id] = output
                    bar.update()
        return [done[i] for i in ids]
