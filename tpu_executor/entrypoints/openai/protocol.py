"""Request bodies of the OpenAI-compatible API (pydantic), and their translation into
``SamplingParams``.

Field names, types and defaults follow OpenAI's API and vLLM's server, including the extras
vLLM users send through ``extra_body`` (``top_k``, ``min_p``, ``ignore_eos``,
``stop_token_ids``, ``min_tokens``, ``structured_outputs`` and the older ``guided_*`` forms of
it). Unknown fields are accepted (and logged by the server).
Fields we know but do not implement are refused with a 400 that names them
(``unsupported_field``), never ignored.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tpu_executor.core.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tpu_executor.entrypoints.openai.request_limits import MAX_MESSAGES, MAX_TOOLS, NOT_IMPLEMENTED, json_value_problem

_INT64 = 2**63


class ApiError(Exception):
    """An error answered in OpenAI's schema ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Union[None, int, str] = None):
        # A message quoting a request's value may hold a lone surrogate, which no response can encode.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type
        self.code = code if code is not None else status

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param)


def checked_text(text: str, param: str) -> str:
    """``text`` if it is Unicode a tokenizer can take, else a 400 naming ``param``: JSON may
    carry a lone UTF-16 surrogate (``"\\ud800"``), which no UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise bad_request(f"{param} is not valid Unicode: a lone surrogate at character {err.start}", param) from None
    return text


def field_named_by(message: str, default: str) -> str:
    """The request field an error message starts with (``SamplingParams`` and the engine name
    the field first), else ``default``."""
    match = re.match(r"[a-z_]+", message)
    return match.group(0) if match and match.group(0) in _FIELD_NAMES else default


class _Body(BaseModel):
    """A request body: every value in it checked by ``request_limits.json_value_problem`` first."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _finite_and_shallow(cls, data: Any) -> Any:
        problem = json_value_problem(data)
        if problem is not None:
            raise bad_request(*problem)
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationRequest(_Body):
    """Fields completions and chat share."""

    model: Optional[str] = None
    n: int = Field(1, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    # vLLM's extras (extra_body)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: Optional[List[int]] = None
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    response_format: Optional[Dict[str, Any]] = None
    structured_outputs: Optional[Dict[str, Any]] = None
    guided_json: Optional[Union[str, Dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    add_special_tokens: Optional[bool] = None  # None: the endpoint's default (vLLM's)
    truncate_prompt_tokens: Optional[int] = Field(None, ge=1)
    truncation_side: Optional[Literal["left", "right"]] = None  # None: left, vLLM's default
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)  # the response's id
    session_id: Optional[str] = None  # the client's session (replicated servers keep it on one replica)
    return_token_ids: Optional[bool] = None  # vLLM's: the prompt's and each choice's token ids in the response

    def check_supported(self) -> None:
        """Refuse what we know but do not implement (the 400 names the field)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in NOT_IMPLEMENTED and value is not None and value not in NOT_IMPLEMENTED[name]:
                raise bad_request(f"{name}={json.dumps(value)[:80]} is not supported by this server", name)
        for text in [self.stop] if isinstance(self.stop, str) else (self.stop or []):
            checked_text(text, "stop")
        self.grammar()

    def grammar_field(self) -> str:
        """The field that asked for a grammar (the one a 400 about it names)."""
        named = [name for name in _GRAMMAR_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            named.insert(0, "response_format")
        return named[0] if named else "structured_outputs"

    def grammar(self) -> Optional[StructuredOutputsParams]:
        """The grammar the output must follow: ``response_format`` (json_object, json_schema),
        vLLM's ``structured_outputs``, or a ``guided_*`` field; at most one of them."""
        field = self.grammar_field()
        specs = [spec for spec in (response_format_grammar(self.response_format), self._vllm_grammar())
                 if spec is not None]
        if len(specs) > 1:
            raise bad_request("response_format, structured_outputs and guided_* each set a grammar; send one", field)
        return specs[0] if specs else None

    def _vllm_grammar(self) -> Optional[StructuredOutputsParams]:
        fields = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        fields = {name: value for name, value in fields.items() if value is not None}
        if self.structured_outputs is not None:
            if fields:
                raise bad_request("structured_outputs and guided_* each set a grammar; send one", "structured_outputs")
            fields = self.structured_outputs
        if not fields:
            return None
        known = set(StructuredOutputsParams.__dataclass_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise bad_request(f"structured_outputs has unknown fields {unknown}; known: {sorted(known)}",
                              self.grammar_field())
        try:
            return StructuredOutputsParams(**fields)
        except (TypeError, ValueError) as err:
            raise bad_request(str(err), self.grammar_field()) from None

    def unknown_fields(self) -> List[str]:
        return sorted(set(self.model_extra or {}) - set(NOT_IMPLEMENTED))

    def truncated(self, prompt):
        """``prompt`` (an encoded ``serving.Prompt``) cut to ``truncate_prompt_tokens`` tokens,
        as vLLM truncates: its last ones, its first with ``truncation_side: right``; a cut
        prompt's text is its tokens' (what ``echo`` returns)."""
        keep = self.truncate_prompt_tokens
        if keep is None or len(prompt.token_ids) <= keep:
            return prompt
        kept = prompt.token_ids[:keep] if self.truncation_side == "right" else prompt.token_ids[-keep:]
        return dataclasses.replace(prompt, text=None, token_ids=kept)

    def wanted_prompt_logprobs(self) -> Optional[int]:
        """Top alternatives per prompt token (vLLM's ``prompt_logprobs``), None for none."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        """The engine's sampling parameters (defaults as vLLM's: temperature 1, top_p 1). A
        request that does not stream asks for its final output only, as in vLLM: the engine
        then makes no delta for it, and the event loop wakes for it once, not every step."""
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_k=self.top_k or 0, top_p=1.0 if self.top_p is None else self.top_p,
                min_p=self.min_p or 0.0, seed=None if self.seed is None else self.seed % _INT64,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                logit_bias=self.token_bias(), min_tokens=self.min_tokens,
                allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                prompt_logprobs=self.wanted_prompt_logprobs(), structured_outputs=self.grammar())
        except ValueError as err:
            raise bad_request(str(err), field_named_by(str(err), "sampling parameters")) from None

    def token_bias(self) -> Dict[int, float]:
        """``logit_bias`` with its keys (token ids as JSON strings) as integers."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"[0-9]{1,18}", key.strip()):  # ASCII digits: int() takes others too
                raise bad_request(f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias")
            bias[int(key)] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk, not only the last (vLLM's ``continuous_usage_stats``,
        which, as there, takes effect together with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


_GRAMMAR_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def response_format_grammar(response_format: Optional[Dict[str, Any]]) -> Optional[StructuredOutputsParams]:
    """OpenAI's ``response_format`` as a grammar: ``text`` (none), ``json_object``, or
    ``json_schema`` with its ``json_schema.schema``."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")
    described = response_format.get("json_schema")
    schema = described.get("schema") if isinstance(described, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format json_schema needs json_schema.schema: a JSON Schema object",
                          "response_format")
    return StructuredOutputsParams(json=schema)


PromptInput = Union[str, List[str], List[int], List[List[int]]]


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0)
    echo: bool = False
    best_of: Optional[int] = Field(None, ge=1)
    suffix: Optional[str] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported by this server", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")

    def wanted_prompt_logprobs(self) -> Optional[int]:
        """``echo`` with ``logprobs`` scores the prompt too (what evaluation harnesses send)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompts of this request: each a string or a list of token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [checked_text(prompt, "prompt")]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return [checked_text(p, "prompt") if isinstance(p, str) else p for p in prompt]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None  # an assistant's calls earlier in the conversation
    tool_call_id: Optional[str] = None  # a tool message: the call it answers

    def text(self, index: int) -> str:
        """The message's text; content parts other than text are refused."""
        param = f"messages[{index}].content"
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return checked_text(self.content, param)
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts ({'type': 'text', 'text': ...}) are supported", param)
            texts.append(part["text"])
        return checked_text("".join(texts), param)


class ChatTemplateFields(BaseModel):
    """What a chat body gives the chat template beside its messages (vLLM's fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    documents: Optional[List[Dict[str, Any]]] = None

    def check_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt to be false",
                              "continue_final_message")

    def request_template(self) -> Tuple[Optional[str], Optional[str]]:
        """The chat template the request brings, and the field it came in: ``chat_template``,
        or (as vLLM reads it too) ``chat_template_kwargs.chat_template``; (None, None) for none."""
        if self.chat_template is not None:
            return self.chat_template, "chat_template"
        template = (self.chat_template_kwargs or {}).get("chat_template")
        if template is None:
            return None, None
        if not isinstance(template, str):
            raise bad_request("chat_template_kwargs.chat_template must be a string", "chat_template_kwargs")
        return template, "chat_template_kwargs"

    def template_kwargs(self) -> Dict[str, Any]:
        """``chat_template_kwargs`` (say Qwen3's ``enable_thinking``) less the names the request's
        own fields set."""
        return {name: value for name, value in (self.chat_template_kwargs or {}).items()
                if name not in _TEMPLATE_ARGUMENTS}


class ChatCompletionRequest(_GenerationRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    messages: List[ChatMessage]
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: bool = True
    functions: Optional[List[Dict[str, Any]]] = None
    echo: bool = False
    include_reasoning: bool = True  # with --reasoning-parser: false drops reasoning_content

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported in chat by this server", "echo")
        self.check_template_fields()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        if len(self.messages) > MAX_MESSAGES:
            raise bad_request(f"messages holds {len(self.messages)} messages; at most {MAX_MESSAGES} are allowed",
                              "messages")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise bad_request(f"tools holds {len(self.tools)} tools; at most {MAX_TOOLS} are allowed", "tools")
        if self.functions:
            raise bad_request("functions (the form OpenAI deprecated) is not supported; send tools", "functions")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body, ChatTemplateFields):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    """``POST /detokenize``."""

    model: Optional[str] = None
    tokens: List[int]


# The template's variables and apply_chat_template's arguments, which chat_template_kwargs may
# not set (the request's own fields set them).
_TEMPLATE_ARGUMENTS = {"messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "return_dict", "return_tensors", "padding",
                       "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens",
                       "return_assistant_tokens_mask"}
_FIELD_NAMES = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's): serve the adapter at ``lora_path`` as ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's): stop serving ``lora_name``."""

    lora_name: str
    lora_int_id: Optional[int] = None
