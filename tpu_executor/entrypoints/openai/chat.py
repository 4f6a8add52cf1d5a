"""``POST /v1/chat/completions``: messages rendered with the tokenizer's chat template."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict, List, Optional, Tuple

from starlette.requests import Request as HttpRequest

from tpu_executor.core.request import CompletionOutput, RequestOutput
from tpu_executor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateFields,
    bad_request,
)
from tpu_executor.entrypoints.openai.reasoning import StreamedReasoning, split_reasoning, starts_in_reasoning
from tpu_executor.entrypoints.openai.serving import (
    OpenAIServing,
    Prompt,
    session_of,
    token_ids,
    token_text,
    usage,
    vllm_prompt_logprobs,
)
from tpu_executor.entrypoints.openai.templates import ChatTemplateError
from tpu_executor.entrypoints.openai.tool_parsers import ParsedCall
from tpu_executor.entrypoints.openai.tools import ToolChoice, conversation_message, tool_call_json


async def render_chat(serving: OpenAIServing, body: ChatTemplateFields, messages: List[ChatMessage],
                      tools: Optional[List[Dict[str, Any]]] = None, add_special_tokens: bool = False) -> Prompt:
    """The conversation (and the tools, when given) as the chat template writes it, encoded:
    the model's template, or the one the request brings if the server trusts request
    templates; rendered off the event loop within the server's limits (``templates.py``), with
    what ``body`` gives the template. The template puts in the special tokens (BOS and the
    like), so by default encoding adds none."""
    template, field = body.request_template()
    if template is not None and not serving.config.trust_request_chat_template:
        raise bad_request(f"{field}: this server does not run chat templates sent in requests (its operator can "
                          "allow them with --trust-request-chat-template)", field)
    fmt = serving.config.tool_call_parser
    conversation = [conversation_message(m, i, fmt) for i, m in enumerate(messages)]
    try:
        source = serving.templates.source(template, tools)
    except ValueError:
        raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages") from None
    try:
        text = await serving.templates.render(
            source, conversation, tools=tools, documents=body.documents,
            add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message,
            template_kwargs=body.template_kwargs())
    except ChatTemplateError as err:  # the template's fault (the request's template, when it brought one)
        raise bad_request(str(err), field or "messages") from None
    except Exception as err:  # noqa: BLE001 - a template may reject a conversation (roles, order)
        raise bad_request(f"the chat template rejected these messages: {err}", "messages") from None
    return Prompt(text, token_ids(serving.tokenizer, text, "messages", add_special_tokens=add_special_tokens))


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
    adapter = serving.check_request(body, "chat/completions")
    tools = ToolChoice(body.tools, body.tool_choice, body.parallel_tool_calls, serving.config.tool_call_parser)
    prompt = await render_chat(serving, body, body.messages, tools.tools, bool(body.add_special_tokens))
    parser = serving.config.reasoning_parser
    in_reasoning = None if parser is None else starts_in_reasoning(parser, prompt.text)
    prompt = body.truncated(prompt)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.max_tokens_for(prompt, body.requested_max_tokens(), param)
    params, grammar_field = body.sampling_params(max_tokens, body.num_logprobs()), body.grammar_field()
    if tools.grammar() is not None:
        if params.structured_outputs is not None:
            raise bad_request(f"tool_choice {tools.mode!r} sets the output's grammar; drop {grammar_field}",
                              grammar_field)
        params, grammar_field = dataclasses.replace(params, structured_outputs=tools.grammar()), "tools"
    await serving.validate(prompt, params, "messages", grammar_field)
    started = serving.start("chatcmpl", [prompt], [params], ("tools",) if tools.calls_tools else (),
                            session_of(body, http), body.request_id, adapter)
    builder = _Response(serving, body, prompt, started.request_ids[0], tools, in_reasoning)
    return await serving.respond(started, builder, body.stream, http)


class _Response:
    """Builds the JSON of one chat call: whole, or chunk by chunk (the first chunk of every
    choice carries the role). ``in_reasoning``: whether an output starts inside its reasoning
    (None: the server splits out no reasoning)."""

    def __init__(self, serving: OpenAIServing, body: ChatCompletionRequest, prompt: Prompt, request_id: str,
                 tools: ToolChoice, in_reasoning: Optional[bool] = None):
        self.serving, self.body, self.prompt, self.tools = serving, body, prompt, tools
        self.in_reasoning = in_reasoning
        self.reasoning_streams: Dict[int, StreamedReasoning] = {}  # by choice index
        self.id, self.created = request_id, int(time.time())
        self.completion_tokens = 0
        self.started_choices: set = set()
        self.streamed: Dict[int, StreamedChoice] = {}  # by choice index, when tools may be called

    def _envelope(self, obj: str, choices: List[Dict[str, Any]], usage_: Optional[Dict[str, int]] = None):
        model = self.body.model or self.serving.config.model_name
        return {"id": self.id, "object": obj, "created": self.created, "model": model,
                "choices": choices, "usage": usage_}

    def _logprobs(self, completion: CompletionOutput):
        if not self.body.logprobs:
            return None
        return chat_logprobs(self.serving.tokenizer, completion, self.body.top_logprobs or 0)

    def whole(self, outputs: List[RequestOutput]) -> Dict[str, Any]:
        choices = []
        for completion in outputs[0].outputs:
            self.completion_tokens += len(completion.token_ids)
            reasoning, answer = (None, completion.text) if self.in_reasoning is None else \
                split_reasoning(completion.text, self.in_reasoning)
            content, calls = self.tools.parse(answer or "") if answer or reasoning is None else (None, [])
            message = {"role": "assistant", "content": content, **self._reasoning_fields(reasoning)}
            if calls:
                message["tool_calls"] = [tool_call_json(call, self.tools.format) for call in calls]
            choices.append({"index": completion.index, "message": message, "logprobs": self._logprobs(completion),
                            "finish_reason": self._finish_reason(completion.finish_reason, calls),
                            "stop_reason": completion.stop_reason, **self._output_ids(completion)})
        response = {**self._envelope("chat.completion", choices, usage([self.prompt], self.completion_tokens)),
                    **self._prompt_ids()}
        if self.body.prompt_logprobs is not None:
            response["prompt_logprobs"] = vllm_prompt_logprobs(self.serving.tokenizer, outputs[0],
                                                               self.body.prompt_logprobs)
        return response

    def chunks(self, prompt_index: int, delta: RequestOutput):
        for completion in delta.outputs:
            self.completion_tokens += len(completion.token_ids)
            if completion.index not in self.started_choices:
                self.started_choices.add(completion.index)
                yield {**self._envelope("chat.completion.chunk", [{
                    "index": completion.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}], self._usage_so_far()), **self._prompt_ids()}
            if completion.text or completion.finish_reason is not None or completion.token_ids:
                delta, calls = self._delta(completion)
                yield self._envelope("chat.completion.chunk", [{
                    "index": completion.index, "delta": delta, "logprobs": self._logprobs(completion),
                    "finish_reason": self._finish_reason(completion.finish_reason, calls),
                    "stop_reason": completion.stop_reason, **self._output_ids(completion)}], self._usage_so_far())

    def _output_ids(self, completion: CompletionOutput) -> Dict[str, Any]:
        """vLLM's ``token_ids`` of a choice or a streamed delta, when the request asks for them."""
        return {"token_ids": list(completion.token_ids)} if self.body.return_token_ids else {}

    def _prompt_ids(self) -> Dict[str, Any]:
        """vLLM's ``prompt_token_ids`` (of a response, or of each choice's first chunk) when asked for."""
        return {"prompt_token_ids": list(self.prompt.token_ids)} if self.body.return_token_ids else {}

    def _delta(self, completion: CompletionOutput) -> Tuple[Dict[str, Any], list]:
        """A streamed choice's delta for its new text, and the calls it carries."""
        finished, reasoning, text = completion.finish_reason is not None, "", completion.text
        if self.in_reasoning is not None:
            stream = self.reasoning_streams.setdefault(completion.index, StreamedReasoning(self.in_reasoning))
            reasoning, text = stream.add(text)
            if finished:
                held_reasoning, held_text = stream.finish()
                reasoning, text = reasoning + held_reasoning, text + held_text
        delta, calls = {"content": text}, []
        if self.tools.calls_tools:
            streamed = self.streamed.setdefault(completion.index, StreamedChoice(self.tools))
            delta, calls = streamed.add(text, finished)
        return {**delta, **self._reasoning_fields(reasoning or None, streamed=True)}, calls

    def _reasoning_fields(self, reasoning: Optional[str], streamed: bool = False) -> Dict[str, Any]:
        """``reasoning_content`` (and vLLM's newer name for it, ``reasoning``) when the server
        splits out reasoning; a stream's delta carries them only when it has some."""
        if self.in_reasoning is None or (streamed and not reasoning):
            return {}
        reasoning = reasoning if self.body.include_reasoning else None
        if streamed and reasoning is None:
            return {}
        return {"reasoning_content": reasoning, "reasoning": reasoning}

    def _finish_reason(self, reason: Optional[str], calls: list) -> Optional[str]:
        """``tool_calls`` when a finished output called tools of the model's own choosing
        (OpenAI keeps ``stop`` for a function the request named)."""
        return "tool_calls" if reason == "stop" and calls and self.tools.mode != "named" else reason

    def _usage_so_far(self) -> Optional[Dict[str, int]]:
        return usage([self.prompt], self.completion_tokens) if self.body.continuous_usage else None

    def final_chunks(self):
        if self.body.include_usage:
            yield self._envelope("chat.completion.chunk", [], usage([self.prompt], self.completion_tokens))


class StreamedChoice:
    """One streamed choice of a request that may call tools: content streams up to where a
    call starts or may start (``ToolChoice.held_from``); the calls go out when the output is
    complete, in one delta. A named function's arguments stream as they come."""

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.text, self.sent = "", 0  # the output so far; how much of it went out as content
        self.named_call_sent = False  # a named function's call went out (its id and name)

    def add(self, new_text: str, finished: bool) -> Tuple[Dict[str, Any], list]:
        """The delta for ``new_text``, and the calls of the model's choosing it carries."""
        self.text += new_text
        if self.tools.mode == "named":
            if not new_text and not self.named_call_sent:  # the call opens with the answer's first text
                return {}, []
            call = {"index": 0, "function": {"arguments": new_text}}
            if not self.named_call_sent:  # the first delta names the call
                call = tool_call_json(ParsedCall(self.tools.named, new_text), self.tools.format, 0)
                self.named_call_sent = True
            return {"tool_calls": [call]}, []
        if not finished:
            held = self.tools.held_from(self.text)
            return self._content(len(self.text) if held is None else held), []
        content, calls = self.tools.parse(self.text)
        delta = self._content(len(content or "") if calls else len(self.text))
        if calls:
            delta["tool_calls"] = [tool_call_json(call, self.tools.format, index) for index, call in enumerate(calls)]
        return delta, calls

    def _content(self, upto: int) -> Dict[str, Any]:
        upto = max(upto, self.sent)
        content, self.sent = self.text[self.sent:upto], upto
        return {"content": content}
