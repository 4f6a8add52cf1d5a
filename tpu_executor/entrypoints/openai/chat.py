"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from starlette.requests import Request as HttpRequest

from tpu_executor.core.request import CompletionOutput, RequestOutput
from tpu_executor.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, bad_request
from tpu_executor.entrypoints.openai.serving import (OpenAIServing, Prompt, token_ids, token_text, usage,
                                                    vllm_prompt_logprobs)


def render_chat(tokenizer, messages: List[ChatMessage], add_generation_prompt: bool) -> Prompt:
    """The conversation as the model's chat template writes it, encoded. The template puts
    in the special tokens (BOS and the like), so encoding adds none."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
    conversation = [{"role": m.role, "content": m.text(i)} for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as err:  # noqa: BLE001 - a template may reject a conversation (roles, order)
        raise bad_request(f"the chat template rejected these messages: {err}", "messages") from None
    return Prompt(text, token_ids(tokenizer, text, "messages", add_special_tokens=False))


def chat_logprobs(tokenizer, completion: CompletionOutput, top: int) -> Dict[str, List[Dict[str, Any]]]:
    """OpenAI's chat ``logprobs``: per token its text, log-prob, bytes and the top alternatives."""
    def entry(token_id: int, logprob: float) -> Dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, entries in zip(completion.token_ids, completion.logprobs or []):
        alternatives = sorted(entries.items(), key=lambda item: -item[1])[:top]
        content.append({**entry(token_id, entries[token_id]),
                        "top_logprobs": [entry(t, lp) for t, lp in alternatives]})
    return {"content": content}


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, http: HttpRequest):
    serving.check_request(body, "chat/completions")
    prompt = render_chat(serving.tokenizer, body.messages, body.add_generation_prompt)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.max_tokens_for(prompt, body.requested_max_tokens(), param)
    params = body.sampling_params(max_tokens, body.num_logprobs())
    await serving.validate(prompt, params, "messages", body.grammar_field())
    started = serving.start("chatcmpl", [prompt], [params])
    builder = _Response(serving, body, prompt, started.request_ids[0])
    return await serving.respond(started, builder, body.stream, http)


class _Response:
    """Builds the JSON of one chat call: whole, or chunk by chunk (the first chunk of every
    choice carries the role)."""

    def __init__(self, serving: OpenAIServing, body: ChatCompletionRequest, prompt: Prompt, request_id: str):
        self.serving, self.body, self.prompt = serving, body, prompt
        self.id, self.created = request_id, int(time.time())
        self.completion_tokens = 0
        self.started_choices: set = set()

    def _envelope(self, obj: str, choices: List[Dict[str, Any]], usage_: Optional[Dict[str, int]] = None):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.serving.config.model_name,
                "choices": choices, "usage": usage_}

    def _logprobs(self, completion: CompletionOutput):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.serving.tokenizer, completion, self.body.top_logprobs or 0)

    def whole(self, outputs: List[RequestOutput]) -> Dict[str, Any]:
        choices = []
        for completion in outputs[0].outputs:
            self.completion_tokens += len(completion.token_ids)
            choices.append({"index": completion.index, "message": {"role": "assistant", "content": completion.text},
                            "logprobs": self._logprobs(completion), "finish_reason": completion.finish_reason,
                            "stop_reason": completion.stop_reason})
        response = self._envelope("chat.completion", choices, usage([self.prompt], self.completion_tokens))
        if self.body.prompt_logprobs is not None:
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.serving.tokenizer, outputs[0],
                                                               self.body.prompt_logprobs)
        return response

    def chunks(self, prompt_index: int, delta: RequestOutput):
        for completion in delta.outputs:
            self.completion_tokens += len(completion.token_ids)
            if completion.index not in self.started_choices:
                self.started_choices.add(completion.index)
                yield self._envelope("chat.completion.chunk", [{
                    "index": completion.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}], self._usage_so_far())
            if completion.text or completion.finish_reason is not None or completion.token_ids:
                yield self._envelope("chat.completion.chunk", [{
                    "index": completion.index, "delta": {"content": completion.text},
                    "logprobs": self._logprobs(completion), "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason}], self._usage_so_far())

    def _usage_so_far(self) -> Optional[Dict[str, int]]:
        return usage([self.prompt], self.completion_tokens) if self.body.continuous_usage else None

    def final_chunks(self):
        if self.body.include_usage:
            yield self._envelope("chat.completion.chunk", [], usage([self.prompt], self.completion_tokens))
