"""``--reasoning-parser``: a chat output's ``<think>`` block returned as ``reasoning_content``,
whole and streamed. The parser on its own over every way a stream can cut an output, then a
live server whose tiny model is made to think by a regex grammar (its random weights never
would), read by the ``openai`` client. Its engine runs without ``reasoning_parser``, so the
grammar covers the whole output (``test_reasoning_grammars.py``: grammars after the reasoning)."""
from __future__ import annotations

import json

import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.entrypoints.openai.reasoning import StreamedReasoning, split_reasoning, starts_in_reasoning

CASES = [  # (output, starts in reasoning, reasoning, content)
    ("<think>add 2 and 2</think>\n\nfour", False, "add 2 and 2", "\n\nfour"),
    ("  <think>hm</think>ok", False, "hm", "ok"),
    ("plain answer", False, None, "plain answer"),
    ("<thin k", False, None, "<thin k"),
    ("a < b", False, None, "a < b"),
    ("<think>cut by max_tokens </thi", False, "cut by max_tokens </thi", None),
    ("opened by the prompt</think>answer", True, "opened by the prompt", "answer"),
    ("still thinking", True, "still thinking", None),
    ("</think>", True, None, None),
    ("", False, None, None),
]


@pytest.mark.parametrize("output,in_reasoning,reasoning,content", CASES)
def test_whole_output_splits(output, in_reasoning, reasoning, content):
    assert split_reasoning(output, in_reasoning) == (reasoning, content)


@pytest.mark.parametrize("output,in_reasoning,reasoning,content", CASES)
def test_every_cut_of_a_stream_gives_the_whole_split(output, in_reasoning, reasoning, content):
    cuts = [[output[:i], output[i:j], output[j:]] for i in range(len(output) + 1)
            for j in range(i, len(output) + 1)]
    for pieces in cuts + [list(output)]:
        stream, parts = StreamedReasoning(in_reasoning), [("", "")]
        parts += [stream.add(piece) for piece in pieces] + [stream.finish()]
        streamed = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert streamed == (reasoning, content), pieces


def test_where_each_parser_starts():
    assert starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", "<|im_start|>assistant\n")
    assert not starts_in_reasoning("qwen3", None)
    assert starts_in_reasoning("deepseek_r1", "<｜Assistant｜>")


THINK_THEN_ANSWER = r"<think>[a-z]{2,6}</think>[a-z]{2,6}"
TOOLS = [{"type": "function", "function": {"name": "now"}}]  # a short prompt: the context holds 320 tokens
THINK_THEN_CALL = r'<think>[a-z]{2,6}</think><tool_call>\{"name":"now","arguments":\{\}\}</tool_call>'
OPENS_THINK = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}<think>\n"


@pytest.fixture(scope="module")
def client(checkpoints):
    from openai import OpenAI

    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    with live_server(engine, reasoning_parser="qwen3", tool_call_parser="hermes",
                     trust_request_chat_template=True) as (url, _):
        yield OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, pattern: str, stream: bool = False, **fields):
    extra = fields.pop("extra_body", {})
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "what is two and two"}], temperature=0,
        max_tokens=fields.pop("max_tokens", 64), stream=stream,
        extra_body={"structured_outputs": {"regex": pattern}, **extra}, **fields)


def streamed_message(chunks) -> dict:
    """A stream's deltas put together: reasoning, content and tool calls."""
    message = {"reasoning_content": "", "content": "", "tool_calls": []}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            message["content"] += delta.get("content") or ""
            message["tool_calls"] += delta.get("tool_calls") or []
    return message


def test_reasoning_is_split_out_whole_and_streamed(client):
    message = ask(client, THINK_THEN_ANSWER).choices[0].message.model_dump()
    raw = "<think>" + message["reasoning_content"] + "</think>" + message["content"]
    assert message["reasoning"] == message["reasoning_content"]
    assert 2 <= len(message["reasoning_content"]) <= 6 and message["reasoning_content"].isalpha(), raw
    assert 2 <= len(message["content"]) <= 6 and message["content"].isalpha(), raw
    streamed = streamed_message(ask(client, THINK_THEN_ANSWER, stream=True))
    assert (streamed["reasoning_content"], streamed["content"]) == (message["reasoning_content"],
                                                                    message["content"])


def test_include_reasoning_false_drops_it(client):
    message = ask(client, THINK_THEN_ANSWER, extra_body={"include_reasoning": False}).choices[0].message
    assert message.model_dump()["reasoning_content"] is None and message.content.isalpha()
    streamed = streamed_message(ask(client, THINK_THEN_ANSWER, stream=True, extra_body={"include_reasoning": False}))
    assert streamed["reasoning_content"] == "" and streamed["content"].isalpha()


def test_tool_calls_are_read_after_the_reasoning(client):
    for stream in (False, True):
        response = ask(client, THINK_THEN_CALL, stream=stream, tools=TOOLS, max_tokens=80)
        message = streamed_message(response) if stream else response.choices[0].message.model_dump()
        assert message["reasoning_content"].isalpha() and not message["content"]
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "now" and json.loads(call["function"]["arguments"]) == {}


def test_a_prompt_that_opens_think_starts_the_output_in_reasoning(client):
    fields = {"extra_body": {"chat_template": OPENS_THINK}}
    message = ask(client, r"[a-z]{2,6}</think>[a-z]{2,6}", **fields).choices[0].message.model_dump()
    assert message["reasoning_content"].isalpha() and message["content"].isalpha()
    streamed = streamed_message(ask(client, r"[a-z]{2,6}</think>[a-z]{2,6}", stream=True, **fields))
    assert (streamed["reasoning_content"], streamed["content"]) == (message["reasoning_content"],
                                                                    message["content"])
