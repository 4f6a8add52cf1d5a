"""Tool calls read out of sample outputs of each format (Hermes/Qwen, Llama 3 JSON, Mistral),
whole and streamed in random pieces; outputs that are not calls stay content; the tools and
tool_choice of a request checked, and the grammars of ``required`` and a named function."""
from __future__ import annotations

import json
import random

import pytest

from tpu_executor.entrypoints.openai.chat import StreamedChoice
from tpu_executor.entrypoints.openai.protocol import ApiError
from tpu_executor.entrypoints.openai.tool_parsers import ParsedCall, parse
from tpu_executor.entrypoints.openai.tools import ToolChoice

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "celsius"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "CET"}))
# (format, a model's output, the content the response holds, the calls)
SAMPLES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
               '</tool_call>', "Let me check.\n", [WEATHER, TIME]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>', None, [TIME]),
    ("hermes", "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}", None, [TIME]),
    ("hermes", "It is sunny in Paris; <tool is not a call.", "It is sunny in Paris; <tool is not a call.", []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {broken</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {broken</tool_call>', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [WEATHER]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}', None, [WEATHER, TIME]),
    ("llama3_json", "The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [WEATHER, TIME]),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "CET"}}]', None, [TIME]),
    ("mistral", "Sure: [TOOL_CALLS][{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}]", "Sure: ",
     [TIME]),
    ("mistral", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("fmt, output, content, calls", SAMPLES)
def test_a_whole_output_gives_its_content_and_calls(fmt, output, content, calls):
    assert parse(output, fmt) == (content, calls)


@pytest.mark.parametrize("fmt, output, content, calls", SAMPLES)
def test_a_streamed_output_gives_the_same_content_and_calls_in_any_pieces(fmt, output, content, calls):
    rng = random.Random(len(output))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(output)), rng.randint(0, min(12, len(output) - 1))))
        pieces = [output[a:b] for a, b in zip([0] + cuts, cuts + [len(output)])]
        stream = StreamedChoice(ToolChoice(TOOLS, "auto", True, fmt))
        deltas = [stream.add(piece, last)[0] for last, piece in zip([False] * (len(pieces) - 1) + [True], pieces)]
        streamed_content = "".join(d.get("content") or "" for d in deltas)
        assert streamed_content == (content or "")
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == \
            [(c.name, c.arguments) for c in calls]
        assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
        if calls:  # no piece of a call went out as content
            assert "{" not in streamed_content or fmt == "hermes" and "<tool_call>" not in streamed_content


def test_required_makes_a_grammar_of_every_tool_and_reads_its_list():
    choice = ToolChoice(TOOLS, "required", False, "hermes")
    schema = json.loads(choice.grammar().json)
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == \
        ["get_weather", "get_time"]
    assert choice.parse('[{"name": "get_time", "parameters": {"zone": "CET"}}]') == (None, [TIME])
    assert "maxItems" not in json.loads(ToolChoice(TOOLS, "required", True, "hermes").grammar().json)


def test_a_named_function_constrains_to_its_arguments_and_streams_them():
    choice = ToolChoice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, "hermes")
    assert json.loads(choice.grammar().json) == TOOLS[1]["function"]["parameters"]
    stream = StreamedChoice(choice)
    assert stream.add("", False)[0] == {}  # the call opens with the answer's first text (none yet)
    deltas = [stream.add(text, last)[0]["tool_calls"] for text, last in (('{"zone": ', False), ('"CET"}', True))]
    assert deltas[0][0]["function"] == {"name": "get_time", "arguments": '{"zone": '} and deltas[0][0]["id"]
    assert deltas[1:] == [[{"index": 0, "function": {"arguments": '"CET"}'}}]]


@pytest.mark.parametrize("tools, tool_choice, message", [
    ([{"type": "retrieval"}], "auto", "must be {'type': 'function'"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "function.name must be"),
    ([TOOLS[0], TOOLS[0]], "auto", "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "auto",
     "tools[0].function.parameters is not a valid JSON Schema"),
    (None, "required", "needs tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not among the tools"),
])
def test_bad_tools_and_choices_are_refused(tools, tool_choice, message):
    with pytest.raises(ApiError) as caught:
        ToolChoice(tools, tool_choice, True, "hermes")
    assert caught.value.status == 400 and message in caught.value.message


def test_no_tools_or_none_leave_the_output_as_text():
    for choice in (ToolChoice(None, None, True, "hermes"), ToolChoice(TOOLS, "none", True, "hermes")):
        assert not choice.calls_tools and choice.grammar() is None
        assert choice.parse(SAMPLES[0][1]) == (SAMPLES[0][1], [])
