"""Offline entry point: ``LLM(model=..., device=...).generate(prompts, params)``."""
from __future__ import annotations

from dataclasses import replace
from typing import List, Optional, Sequence, Union

from tqdm import tqdm

from tpu_executor.core.lora import LoRARequest
from tpu_executor.core.request import RequestOutput, accumulate_deltas
from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams
from tpu_executor.engine.llm_engine import LLMEngine, PromptType
from tpu_executor.engine.stats import EngineStats


class LLM:
    """Offline batched generation, shaped like vLLM's ``LLM``.

    Keyword options are the engine options (``tpu_executor/engine/options.py``; the same names
    as the command line's flags), e.g. ``device="cpu"``, ``max_model_len=512``,
    ``block_size=16``, ``max_num_seqs=8``, ``prefill_buckets=(64, 128)``, ``strict=True``,
    ``tensor_parallel_size=4``, ``ray_address="auto"``, ``quantization="int8"``.
    """

    def __init__(self, model: str, show_progress: bool = True, **options):
        self.engine = LLMEngine.from_options(model, show_progress=show_progress, **options)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        """The engine's figures (start-up phases, compilations, padding, cache, scheduling)."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the workers (Ray actors release their chips)."""
        self.engine.shutdown()

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = True,
                 lora_request: Union[None, LoRARequest, Sequence[Optional[LoRARequest]]] = None) -> List[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. ``lora_request``: one
        LoRA adapter for every prompt, or one per prompt (None: the base model); the engine must
        have been started with ``enable_lora=True``.

        All prompts are validated before any is queued, so a bad one raises ValueError and
        leaves the engine as it was. Requests run with ``RequestOutputKind.FINAL_ONLY`` (as in
        vLLM): only the finished outputs are read.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        adapters = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(adapters)} lora requests for {len(prompts)} prompts")
        token_ids = [self.engine.prepare_prompt(prompt, p) for prompt, p in zip(prompts, params)]
        for adapter in adapters:
            self.engine.checks.lora(adapter)
        ids = [self.engine.add_request(prompt, p, prompt_token_ids=t, lora_request=adapter)
               for prompt, p, t, adapter in zip(prompts, params, token_ids, adapters)]
        return self._run(ids, use_tqdm)

    def _run(self, ids: List[str], use_tqdm: bool) -> List[RequestOutput]:
        """Step until every request finished; each one's deltas added up."""
        deltas: List[RequestOutput] = []
        unfinished = set(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while unfinished:
                for delta in self.engine.step():
                    if delta.request_id not in unfinished:
                        continue  # a request someone else queued on this engine
                    deltas.append(delta)
                    if delta.finished:
                        unfinished.discard(delta.request_id)
                        bar.update()
        outputs = accumulate_deltas(deltas)
        return [outputs[i] for i in ids]
