"""Structured outputs over HTTP, read by the ``openai`` client: ``response_format`` (json_schema,
json_object), vLLM's ``structured_outputs`` and ``guided_*`` extras give the offline engine's
outputs, which validate; bad grammars are 400s naming their field and the next request
succeeds; 64 concurrent constrained and plain requests, streamed and whole, are all right;
the metrics count them."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.common import live_server, run_to_end, tiny_engine_options
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.core.sampling_params import StructuredOutputsParams
from tpu_executor.engine.llm_engine import LLMEngine

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["id", "ok"], "additionalProperties": False}
REGEX = r"[a-d]{1,3}(-[0-9]{2}){1,2}"
CHOICES = ["alpha", "beta gamma", "delta"]
MESSAGES = [{"role": "user", "content": "give me json"}]
PROMPTS = [f"request number {i}" for i in range(64)]
# What each kind of request sends (extra_body) and the engine's spec for it.
KINDS = {
    "json": ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
             StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    "regex": ({"structured_outputs": {"regex": REGEX}}, StructuredOutputsParams(regex=REGEX)),
    "choice": ({"guided_choice": CHOICES}, StructuredOutputsParams(choice=CHOICES)),
    "plain": ({}, None),
}


def offline(engine: LLMEngine, prompts, params):
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    outputs = accumulate_deltas(run_to_end(engine))
    return [outputs[i].outputs[0].text for i in ids]


def kind_of(index: int) -> str:
    return list(KINDS)[index % len(KINDS)]


def params_of(kind: str, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=KINDS[kind][1])


@pytest.fixture(scope="module")
def served(checkpoints):
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu", max_num_seqs=16))
    chat = engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    chat = {"prompt_token_ids": engine.tokenizer(chat, add_special_tokens=False)["input_ids"]}
    def chat_ref(max_tokens: int, **grammar):
        spec = StructuredOutputsParams(**grammar)
        return offline(engine, [chat], [SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec)])

    refs = {"mixed": offline(engine, PROMPTS, [params_of(kind_of(i)) for i in range(len(PROMPTS))]),
            "schema": chat_ref(250, json=SCHEMA), "object": chat_ref(60, json_object=True)}
    with live_server(engine) as (url, async_engine):
        yield url, refs


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema_whole_and_streamed(client, served):
    response_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=250,
                                           response_format=response_format)
    chunks = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=250,
                                            response_format=response_format, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content
    assert text == streamed == served[1]["schema"][0]
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object_is_the_engines(client, served):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=60,
                                           response_format={"type": "json_object"})
    assert whole.choices[0].message.content == served[1]["object"][0]
    assert whole.choices[0].message.content.startswith("{")


def test_vllm_extras_regex_choice_and_guided_json(client):
    regex = client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=1.0, seed=3,
                                      extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, regex.choices[0].text)
    choice = client.completions.create(model="tiny", prompt="x", max_tokens=40, temperature=1.0, seed=4,
                                       extra_body={"structured_outputs": {"choice": CHOICES}})
    assert choice.choices[0].text in CHOICES
    guided = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=250, temperature=1.0,
                                            seed=5, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(guided.choices[0].message.content), SCHEMA)


BAD = [
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "not a valid JSON Schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
    ("completions", {"structured_outputs": {"regex": "(["}}, "structured_outputs", "cannot be compiled"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ("completions", {"structured_outputs": {"jsonn": {}}}, "structured_outputs", "unknown fields"),
    ("completions", {"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "cannot be compiled"),
    ("completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("completions", {"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "send one"),
    ("chat", {"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format", "send one"),
    # Found only while decoding: the request's own bans leave its grammar no token.
    ("completions", {"guided_choice": ["alpha"], "allowed_token_ids": [5]}, "structured_outputs", "leave no token"),
    ("chat", {"response_format": {"type": "json_object"}, "bad_words": ["{"]}, "structured_outputs",
     "leave no token"),
]


@pytest.mark.parametrize("endpoint, fields, param, message", BAD)
def test_a_bad_grammar_is_a_400_naming_its_field_and_the_next_request_succeeds(served, endpoint, fields, param,
                                                                                message):
    body = {"model": "tiny", "max_tokens": 5, **fields}
    body.update({"messages": MESSAGES} if endpoint == "chat" else {"prompt": "x"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(served[0] + path, json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    ok = httpx.post(served[0] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 20, "structured_outputs": {"choice": ["fine"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_64_concurrent_constrained_and_plain_requests_streamed_and_whole(served):
    async def one(client: openai.AsyncOpenAI, index: int) -> str:
        extra = KINDS[kind_of(index)][0]
        if index % 2:
            response = await client.completions.create(model="tiny", prompt=PROMPTS[index], max_tokens=40,
                                                       temperature=0, extra_body=extra)
            return response.choices[0].text
        chunks = await client.completions.create(model="tiny", prompt=PROMPTS[index], max_tokens=40,
                                                 temperature=0, extra_body=extra, stream=True)
        return "".join([c.choices[0].text async for c in chunks if c.choices])

    async def run_all():
        async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(PROMPTS))))

    texts = asyncio.run(run_all())
    assert texts == served[1]["mixed"]
    for index, text in enumerate(texts):
        kind = kind_of(index)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        elif kind == "choice":
            assert text in CHOICES


def test_metrics_count_structured_requests_and_compile_times(served):
    httpx.post(served[0] + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 20, "structured_outputs": {"choice": ["metric", "counted"]},
        "presence_penalty": 0.5})
    page = httpx.get(served[0] + "/metrics", timeout=60).text
    counted = {feature: float(value) for feature, value in
               re.findall(r'tpu_executor:requests_by_feature_total\{feature="(\w+)"\} ([0-9.e+]+)', page)}
    assert counted["structured_outputs"] >= 1 and counted["penalties"] >= 1
    compiles = re.search(r"tpu_executor:grammar_compile_seconds_count ([0-9.e+]+)", page)
    assert compiles and float(compiles.group(1)) >= 1
