"""Grammars under ``--reasoning-parser`` (the engine's and the server's), over HTTP with the
``openai`` client: ``response_format`` and ``tool_choice`` required or named constrain the
answer after ``</think>``, which comes back as ``content`` or ``tool_calls``, the reasoning as
``reasoning_content``, the same whole and streamed, for both parsers.

The tiny Llama's tokenizer gets ``<think>`` and ``</think>`` as tokens (two embedding rows
more). ``logit_bias`` makes it reason: "ka" is raised most and a frequency penalty lowers it at
each use, until ``</think>`` (raised less) overtakes it; no JSON starts with either, so the
reasoning shows the grammar was off, and the answer that it was on after ``</think>``."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["lo", "mi"]}},
          "required": ["n", "tag"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
PLAIN = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no marker: deepseek_r1 reasons anyway
OPENS_THINK = PLAIN + "<think>\n"  # a thinking-only template: qwen3 starts in the reasoning
CLOSES_THINK = PLAIN + "<think>\n\n</think>\n\n"  # enable_thinking false: qwen3 answers at once
REASONED_TOKEN = "ka"


@pytest.fixture(scope="module")
def thinking_checkpoint(checkpoints, tmp_path_factory) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = str(tmp_path_factory.mktemp("thinking"))
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    tokenizer.add_tokens(["<think>", "</think>"])
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32)
    torch.manual_seed(0)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["deepseek_r1", "qwen3"])
def served(request, thinking_checkpoint):
    from openai import OpenAI

    parser = request.param
    engine = LLMEngine.from_options(thinking_checkpoint, reasoning_parser=parser, **tiny_engine_options(device="cpu"))
    with live_server(engine, reasoning_parser=parser, tool_call_parser="hermes",
                     trust_request_chat_template=True) as (url, _):
        vocab = engine.tokenizer.get_vocab()
        bias = {str(vocab[REASONED_TOKEN]): 100, str(vocab["</think>"]): 80}
        yield parser, OpenAI(base_url=url + "/v1", api_key="none", max_retries=0), bias


def ask(served, stream: bool, template=None, **fields):
    """A greedy chat whose reasoning the bias steers (see the module's text); ``template``
    defaults to the one each parser starts reasoning with."""
    parser, client, bias = served
    template = template or (PLAIN if parser == "deepseek_r1" else OPENS_THINK)
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "what time is it"}], temperature=0, max_tokens=80,
        stream=stream, logit_bias=bias, frequency_penalty=2.0, extra_body={"chat_template": template}, **fields)


def message_of(response, stream: bool) -> dict:
    """The message of a whole response, or a stream's deltas put together (calls by index; none
    may open before the reasoning ends)."""
    if not stream:
        message = response.choices[0].message.model_dump()
        calls = [(call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"] or []]
        return {"reasoning_content": message["reasoning_content"], "content": message["content"], "tool_calls": calls}
    reasoning, content, calls = "", "", {}
    for chunk in response:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert not (calls and delta.get("reasoning_content")), "a call went out before the reasoning ended"
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name + (call["function"]["name"] or ""),
                                        arguments + (call["function"]["arguments"] or ""))
    return {"reasoning_content": reasoning or None, "content": content or None,
            "tool_calls": [calls[index] for index in sorted(calls)]}


def assert_reasoned(message: dict) -> None:
    """The reasoning the bias made: "ka" one or more times, and nothing else."""
    reasoning = message["reasoning_content"]
    assert reasoning and reasoning.replace(REASONED_TOKEN, "") == "", message


JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}


def test_a_json_schema_answer_is_the_content_after_the_reasoning(served):
    whole = message_of(ask(served, False, response_format=JSON_SCHEMA), False)
    assert_reasoned(whole)
    jsonschema.validate(json.loads(whole["content"]), SCHEMA)
    assert whole["tool_calls"] == []
    assert message_of(ask(served, True, response_format=JSON_SCHEMA), True) == whole


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_tool_calls_are_read_from_the_answer_after_the_reasoning(served, tool_choice):
    whole = message_of(ask(served, False, tools=TOOLS, tool_choice=tool_choice), False)
    assert_reasoned(whole)
    assert not whole["content"]
    ((name, arguments),) = whole["tool_calls"]
    assert name == "get_time"
    jsonschema.validate(json.loads(arguments), CLOCK)
    assert message_of(ask(served, True, tools=TOOLS, tool_choice=tool_choice), True) == whole


def test_a_prompt_that_closed_the_reasoning_is_answered_by_the_grammar_from_the_first_token(served):
    """qwen3 reads the prompt (thinking turned off: the grammar starts at once, the bias cannot
    make it reason); deepseek_r1 always starts in the reasoning."""
    for stream in (False, True):
        message = message_of(ask(served, stream, CLOSES_THINK, response_format=JSON_SCHEMA), stream)
        if served[0] == "qwen3":
            assert message["reasoning_content"] is None
        else:
            assert_reasoned(message)
        jsonschema.validate(json.loads(message["content"]), SCHEMA)
