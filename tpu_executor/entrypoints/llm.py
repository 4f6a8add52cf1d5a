"""Offline entry point: ``LLM(model=..., device=...).generate(prompts, params)``."""
from __future__ import annotations

from typing import List, Sequence, Union

from tqdm import tqdm

from tpu_executor.core.request import RequestOutput
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.llm_engine import LLMEngine, PromptType
from tpu_executor.engine.options import build_engine_config
from tpu_executor.engine.stats import EngineStats


class LLM:
    """Offline batched generation, shaped like vLLM's ``LLM``.

    Keyword options are the engine options (``tpu_executor/engine/options.py``; the same names
    as the command line's flags), e.g. ``device="cpu"``, ``max_model_len=512``,
    ``block_size=16``, ``max_num_seqs=8``, ``prefill_buckets=(64, 128)``, ``strict=True``,
    ``tensor_parallel_size=4``, ``ray_address="auto"``, ``quantization="int8"``.
    """

    def __init__(self, model: str, show_progress: bool = True, **options):
        from transformers import AutoTokenizer

        config = build_engine_config(model, **options)
        tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = LLMEngine(config, tokenizer, show_progress=show_progress)

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
        """Step until every request finished, accumulating each one's deltas."""
        outputs = {i: None for i in ids}
        unfinished = set(ids)
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while unfinished:
                for delta in self.engine.step():
                    if delta.request_id not in unfinished:
                        continue  # a request someone else queued on this engine
                    if outputs[delta.request_id] is None:
                        outputs[delta.request_id] = RequestOutput(delta.request_id, delta.prompt,
                                                                  delta.prompt_token_ids, [], False)
                    outputs[delta.request_id].add(delta)
                    if delta.finished:
                        unfinished.discard(delta.request_id)
                        bar.update()
        return [outputs[i] for i in ids]
