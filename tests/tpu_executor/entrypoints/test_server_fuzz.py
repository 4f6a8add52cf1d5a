"""Property-based bodies against a live server: valid chat, completions and adapter-load bodies
mutated by hypothesis (fields set to any JSON value, dropped, nested values replaced) must each
get a response below 500, an error in OpenAI's shape naming the problem, and leave the server
serving. 2,100 bodies in all."""
from __future__ import annotations

import copy
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.common import live_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tpu_executor.tools.lora_adapter import write_random_lora_adapter

EXAMPLES_PER_ROUTE = 400
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                         "parameters": SCHEMA}}
COMPLETIONS = [
    {"model": "tiny", "prompt": "hello there", "max_tokens": 2},
    {"model": "tiny", "prompt": [[5, 17, 33], "two"], "max_tokens": 3, "logprobs": 2, "echo": True, "n": 2,
     "stop": ["x"], "seed": 1, "temperature": 0.5, "logit_bias": {"7": 2.0}},
    {"model": "tiny", "prompt": "json please", "max_tokens": 4, "stream": True,
     "stream_options": {"include_usage": True}, "response_format": {"type": "json_schema", "json_schema":
                                                                     {"name": "w", "schema": SCHEMA}}},
]
CHATS = [
    {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"model": "tiny", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "weather?"}]}],
     "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}, "max_tokens": 4},
    {"model": "tiny", "messages": [{"role": "user", "content": "a"},
                                   {"role": "assistant", "content": None, "tool_calls": [
                                       {"id": "c1", "type": "function",
                                        "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
     "tools": [TOOL], "tool_choice": "auto", "stream": True, "max_completion_tokens": 3, "logprobs": True,
     "top_logprobs": 2},
]

# Values that look like the fields' own (the shapes a client gets almost right) beside any JSON.
NEAR_MISSES = ["f", "weather", ["weather"], {"name": "weather"}, {"name": ["weather"]}, {"type": "function"},
               {"type": "json_schema"}, {"type": "json_object"}, {"type": "text"}, "auto", "required", "none",
               "user", "tool", 0, -1, 1, 2 ** 31, 1e308, -0.5, "", [], {}, None, True, [[]], [{}], [None]]
json_values = st.sampled_from(NEAR_MISSES).map(copy.deepcopy) | st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10)


def field_names(model) -> list:
    return sorted(model.model_fields)


def mutated(data, base: dict, fields: list) -> dict:
    """``base`` with one or two mutations (one mostly: a body wrong in one place reaches furthest):
    a field (known or not) set to any JSON value, a field dropped, or a value nested inside the
    body replaced."""
    body = json.loads(json.dumps(base))
    for _ in range(data.draw(st.sampled_from([1, 1, 1, 2]))):
        kind = data.draw(st.sampled_from(["set", "drop", "nested", "nested"]))
        if kind == "set":
            body[data.draw(st.sampled_from(fields) | st.text(max_size=8))] = data.draw(json_values)
        elif kind == "drop" and body:
            body.pop(data.draw(st.sampled_from(sorted(body))))
        else:
            _replace_nested(data, body)
    return body


def _replace_nested(data, body: dict) -> None:
    """Walk down from a random top-level container and replace one value on the way."""
    node = body
    while isinstance(node, (dict, list)) and node:
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        child = node[key]
        if not isinstance(child, (dict, list)) or not child or data.draw(st.booleans()):
            node[key] = data.draw(json_values)
            return
        node = child


def post(url: str, path: str, body) -> httpx.Response:
    """``body`` sent as JSON; NaN and Infinity as Python's encoder writes them (httpx's refuses)."""
    return httpx.post(url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"Content-Type": "application/json"})


def assert_answered_without_a_server_error(response: httpx.Response, body) -> None:
    assert response.status_code < 500, (body, response.status_code, response.text)
    assert "Traceback" not in response.text and 'File "' not in response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_adapters")
    write_random_lora_adapter(checkpoints["llama"], str(root / "good"), rank=4, seed=3)
    engine = LLMEngine.from_options(checkpoints["llama"], enable_lora=True, max_loras=2, max_lora_rank=8,
                                    **tiny_engine_options(device="cpu"))
    with live_server(engine, max_n=4, enable_lora_runtime_updates=True, lora_adapter_root=str(root)) as (url, _):
        yield url


FUZZ = settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@FUZZ
@given(data=st.data())
def test_completions_bodies_never_get_a_server_error(server, data):
    body = mutated(data, data.draw(st.sampled_from(COMPLETIONS)), field_names(CompletionRequest))
    assert_answered_without_a_server_error(post(server, "/v1/completions", body), body)


@FUZZ
@given(data=st.data())
def test_chat_bodies_never_get_a_server_error(server, data):
    body = mutated(data, data.draw(st.sampled_from(CHATS)), field_names(ChatCompletionRequest))
    assert_answered_without_a_server_error(post(server, "/v1/chat/completions", body), body)


@FUZZ
@given(data=st.data())
def test_adapter_load_bodies_never_get_a_server_error(server, data):
    name = data.draw(st.text(min_size=1, max_size=6))
    base = {"lora_name": name, "lora_path": data.draw(st.sampled_from(["good", "missing", "../good", "/etc"]))}
    body = mutated(data, base, ["lora_name", "lora_path"])
    assert_answered_without_a_server_error(post(server, "/v1/load_lora_adapter", body), body)


def test_the_server_serves_after_the_fuzzing(server):
    assert httpx.get(server + "/health").status_code == 200
    response = post(server, "/v1/completions", COMPLETIONS[0])
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
