"""``POST /v1/completions``: one or more prompts (text or token ids), whole or streamed."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence

from starlette.requests import Request as HttpRequest

from tpu_executor.core.request import CompletionOutput, RequestOutput
from tpu_executor.entrypoints.openai.protocol import CompletionRequest, bad_request
from tpu_executor.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    session_of,
    token_text,
    usage,
    vllm_prompt_logprobs,
)


class CompletionLogprobs:
    """OpenAI's completions ``logprobs`` object of one choice, built delta by delta (text
    offsets continue across deltas)."""

    def __init__(self, tokenizer, start_offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = start_offset

    def build(self, token_ids: Sequence[int], logprobs: Sequence[Optional[Dict[int, float]]],
              width: Optional[int] = None) -> Dict[str, List[Any]]:
        """The object for ``token_ids`` and their log-prob entries (None: a token without one,
        the prompt's first); ``width`` trims the alternatives (the prompt's come wider)."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entries in zip(token_ids, logprobs):
            text = token_text(self.tokenizer, token_id)
            tokens.append(text)
            token_logprobs.append(None if entries is None else entries[token_id])
            keep = None if width is None else width + 1  # the token itself, then its alternatives
            alternatives = None if entries is None else dict(list(entries.items())[:keep])
            top.append(None if alternatives is None else
                       {token_text(self.tokenizer, t): lp for t, lp in alternatives.items()})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def merged(first: Dict[str, List[Any]], then: Dict[str, List[Any]]) -> Dict[str, List[Any]]:
    return {key: first[key] + then[key] for key in first}




async def create_completion(serving: OpenAIServing, body: CompletionRequest, http: HttpRequest):
    adapter = serving.check_request(body, "completions")
    raw_prompts = body.prompts()
    if len(raw_prompts) > serving.config.max_prompts:
        raise bad_request(f"prompt lists {len(raw_prompts)} prompts but this server allows at most "
                          f"{serving.config.max_prompts} per request", "prompt")
    add_special_tokens = body.add_special_tokens is not False  # completions add them unless told not to
    prompts = [serving.encode(p, "prompt", add_special_tokens) for p in raw_prompts]
    prompts = [body.truncated(p) for p in prompts]
    params = [body.sampling_params(serving.max_tokens_for(p, body.max_tokens), body.logprobs) for p in prompts]
    for prompt, p in zip(prompts, params):
        await serving.validate(prompt, p, "prompt", body.grammar_field())
    started = serving.start("cmpl", prompts, params, session=session_of(body, http), client_id=body.request_id,
                            adapter=adapter)
    builder = _Response(serving, body, prompts, started.request_ids[0])
    return await serving.respond(started, builder, body.stream, http)


class _Response:
    """Builds the JSON of one completions call: whole, or chunk by chunk."""

    def __init__(self, serving: OpenAIServing, body: CompletionRequest, prompts: List[Prompt], request_id: str):
        self.serving, self.body, self.prompts = serving, body, prompts
        self.id, self.created = request_id, int(time.time())
        self.completion_tokens = 0
        self.logprobs: Dict[int, CompletionLogprobs] = {}
        self.echoed: set = set()
        self.scored_prompts: Dict[int, RequestOutput] = {}  # prompt index -> the output with its log-probs

    def _prompt_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.serving.tokenizer.decode(prompt.token_ids)

    def _envelope(self, choices: List[Dict[str, Any]], usage_: Optional[Dict[str, int]] = None) -> Dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.body.model or self.serving.config.model_name, "choices": choices, "usage": usage_}

    def _choice(self, prompt_index: int, completion: CompletionOutput, output: RequestOutput) -> Dict[str, Any]:
        """One choice of ``output`` (whole, or a delta: the echoed prompt and its log-probs go
        out with a choice's first)."""
        index = prompt_index * self.body.n + completion.index
        text, first = completion.text, index not in self.echoed
        self.echoed.add(index)
        if output.prompt_logprobs is not None:  # in one delta of a prompt's samples: keep it for the others
            self.scored_prompts[prompt_index] = output
        output = self.scored_prompts.get(prompt_index, output)
        if self.body.echo and first and not self.body.return_token_ids:  # vLLM's: the ids stand for the text
            text = self._prompt_text(self.prompts[prompt_index]) + text
        logprobs = None
        if self.body.logprobs is not None:
            builder = self.logprobs.setdefault(index, CompletionLogprobs(self.serving.tokenizer))
            prompt = builder.build(output.prompt_token_ids, output.prompt_logprobs, self.body.logprobs) \
                if self.body.echo and first else None
            logprobs = builder.build(completion.token_ids, completion.logprobs or [])
            logprobs = merged(prompt, logprobs) if prompt else logprobs
        self.completion_tokens += len(completion.token_ids)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason}
        if self.body.prompt_logprobs is not None and first:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(self.serving.tokenizer, output, self.body.prompt_logprobs)
        if self.body.return_token_ids:  # vLLM's: the prompt's ids with a choice's first delta, then its own
            if first:
                choice["prompt_token_ids"] = list(self.prompts[prompt_index].token_ids)
            choice["token_ids"] = list(completion.token_ids)
        return choice

    def whole(self, outputs: List[RequestOutput]) -> Dict[str, Any]:
        choices = [self._choice(i, c, output) for i, output in enumerate(outputs) for c in output.outputs]
        return self._envelope(choices, usage(self.prompts, self.completion_tokens))

    def chunks(self, prompt_index: int, delta: RequestOutput):
        for completion in delta.outputs:
            choice = self._choice(prompt_index, completion, delta)
            if choice["text"] or choice["finish_reason"] is not None or completion.token_ids:
                yield self._envelope([choice], self._usage_so_far())

    def _usage_so_far(self) -> Optional[Dict[str, int]]:
        return usage(self.prompts, self.completion_tokens) if self.body.continuous_usage else None

    def final_chunks(self):
        if self.body.include_usage:
            yield self._envelope([], usage(self.prompts, self.completion_tokens))
