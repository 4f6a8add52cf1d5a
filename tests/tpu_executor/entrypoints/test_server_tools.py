"""Tool calling over HTTP, read by the ``openai`` client on a tiny random Llama whose chat
template writes tools as Qwen does: ``required`` and a named function always give calls whose
arguments validate against the tool's schema (whole and streamed alike); ``auto`` reads Hermes
calls out of the output (here forced by a regex) and leaves other text as content; earlier
calls and tool results in the conversation go through the template; bad tools are 400s."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
MESSAGES = [{"role": "user", "content": "weather in paris for three days?"}]
FORCED_CALL = r'Checking\.<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'


@pytest.fixture(scope="module")
def served(checkpoints):
    # The tools' JSON makes prompts of ~600 tokens with the tiny tokenizer.
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(
        device="cpu", max_model_len=1024, prefill_buckets=(128, 1024), decode_context_buckets=(1024,)))
    with live_server(engine) as (url, _):
        yield url, engine.tokenizer


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def ask(client, stream=False, **kwargs):
    kwargs.setdefault("max_tokens", 150)
    return client.chat.completions.create(model="tiny", messages=kwargs.pop("messages", MESSAGES), tools=TOOLS,
                                          stream=stream, **kwargs)


def streamed_calls(chunks):
    """(content, {index: [name, arguments]}, finish reason) of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, calls, finish


def assert_valid_calls(calls):
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_always_gives_valid_calls_whole_and_streamed(client, served, parallel):
    # A random model would list calls until max_tokens: a bias on the tokens that close the list
    # ends it once the grammar allows (the bias cannot make the grammar let a token through).
    tokenizer = served[1]
    closing = {str(t): 100.0 for t in range(len(tokenizer)) if "]" in tokenizer.decode([t])}
    for seed in range(4):
        whole = ask(client, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                    logit_bias=closing)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        assert_valid_calls([(c.function.name, c.function.arguments) for c in message.tool_calls])
        assert parallel or len(message.tool_calls) == 1
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in message.tool_calls)
        content, calls, finish = streamed_calls(ask(client, stream=True, tool_choice="required",
                                                    parallel_tool_calls=parallel, temperature=1.0, seed=seed,
                                                    logit_bias=closing))
        assert finish == "tool_calls" and content == ""
        assert [tuple(calls[i]) for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                           for c in message.tool_calls]


def test_a_named_function_gets_its_arguments_whole_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(client, tool_choice=choice, temperature=0)
    call = whole.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and whole.choices[0].finish_reason == "stop"
    assert_valid_calls([(call.function.name, call.function.arguments)])
    _, calls, _ = streamed_calls(ask(client, stream=True, tool_choice=choice, temperature=0))
    assert calls == {0: ["get_weather", call.function.arguments]}


def test_auto_reads_hermes_calls_out_of_the_output_whole_and_streamed(client):
    forced = {"structured_outputs": {"regex": FORCED_CALL}}
    whole = ask(client, tool_choice="auto", temperature=0, extra_body=forced)
    message = whole.choices[0].message
    assert message.content == "Checking." and whole.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    assert_valid_calls([("get_time", message.tool_calls[0].function.arguments)])
    content, calls, finish = streamed_calls(ask(client, stream=True, tool_choice="auto", temperature=0,
                                                extra_body=forced))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert calls == {0: ["get_time", message.tool_calls[0].function.arguments]}


TWO_CALLS = FORCED_CALL + r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(client, parallel):
    forced = {"structured_outputs": {"regex": TWO_CALLS}}
    whole = ask(client, tool_choice="auto", temperature=0, parallel_tool_calls=parallel, extra_body=forced,
                max_tokens=400)
    assert len(whole.choices[0].message.tool_calls) == (2 if parallel else 1)
    _, calls, _ = streamed_calls(ask(client, stream=True, tool_choice="auto", temperature=0,
                                     parallel_tool_calls=parallel, extra_body=forced, max_tokens=400))
    assert len(calls) == (2 if parallel else 1)


def test_auto_leaves_plain_text_as_content(client):
    whole = ask(client, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"
    content, calls, _ = streamed_calls(ask(client, stream=True, temperature=0, max_tokens=12,
                                           extra_body={"ignore_eos": True}))
    assert calls == {} and content == whole.choices[0].message.content


def test_earlier_calls_and_tool_results_go_through_the_chat_template(client, served):
    arguments = '{"city": "Oslo", "days": 2}'
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "rain"}]
    response = ask(client, messages=messages, tool_choice="none", temperature=0, max_tokens=4)
    template_messages = [dict(m) for m in messages]
    template_messages[1]["tool_calls"] = [{"id": "call-1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.loads(arguments)}}]
    text = served[1].apply_chat_template(template_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_call>" in text and "rain" in text and '"forecast"' in text
    assert response.usage.prompt_tokens == len(served[1](text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("fields, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools",
     "not a valid JSON Schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "sets the output's grammar"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "without tool_call_id"),
    ({"functions": [{"name": "f"}]}, "functions", "send tools"),
    # tool_choice objects and call ids of the wrong JSON type or shape
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_time"}}, "tool_choice",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["get_time"]}}}, "tool_choice",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}}, "tool_choice",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": ["get_time"]}}, "tool_choice",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"tools": TOOLS, "tool_choice": {"type": "xml", "function": {"name": "get_time"}}}, "tool_choice",
     "{'type': 'function', 'function': {'name': ...}}"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": 7, "function": {"name": "get_time"}}]}]},
     "messages[0]", "ids must be strings"),
])
def test_bad_tools_are_a_400_naming_the_field(served, fields, param, message):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}
    response = httpx.post(served[0] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_metrics_count_requests_with_tools(served, client):
    ask(client, tool_choice="auto", temperature=0, max_tokens=2)
    page = httpx.get(served[0] + "/metrics", timeout=60).text
    assert re.search(r'tpu_executor:requests_by_feature_total\{feature="tools"\} [1-9]', page)
