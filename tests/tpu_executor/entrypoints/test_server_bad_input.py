"""Bad requests to the server: each gets a 4xx in OpenAI's error schema with a message that
names the problem (and ``param`` where a field is at fault), no stack trace, and the server
answers the next good request."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.common import live_server, replicated_server, tiny_engine_options
from tpu_executor.engine.llm_engine import LLMEngine

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": "tiny", "prompt": "hello there", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def completions(**fields):
    return dict(GOOD, **fields)


def chat(**fields):
    return dict(CHAT, **fields)


def escaped(body) -> bytes:
    """``body`` as JSON with every non-ASCII character escaped, lone surrogates included (valid
    JSON that no UTF-8 encoder accepts once decoded)."""
    return json.dumps(body).encode("ascii")


def deep_schema(depth: int) -> dict:
    """A JSON Schema of objects nested ``depth`` levels deep."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# (name, path, body (dict: JSON; bytes: raw), extra headers, status, words the message holds, param)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "a", ', {}, 400, "not valid JSON", None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, "JSON", None),
    ("body is a list", "/v1/completions", b'[1, 2]', {}, 400, "JSON object", None),
    ("missing prompt", "/v1/completions", {"model": "tiny"}, {}, 400, "prompt", "prompt"),
    ("prompt wrong type", "/v1/completions", completions(prompt=3.5), {}, 400, "prompt", "prompt"),
    ("empty prompt", "/v1/completions", completions(prompt=""), {}, 400, "empty", "prompt"),
    ("empty prompt list", "/v1/completions", completions(prompt=[]), {}, 400, "empty", "prompt"),
    ("token id out of vocab", "/v1/completions", completions(prompt=[5, 100000]), {}, 400, "vocabulary", "prompt"),
    ("negative token id", "/v1/completions", completions(prompt=[5, -1]), {}, 400, "vocabulary", "prompt"),
    ("max_tokens string", "/v1/completions", completions(max_tokens="ten"), {}, 400, "integer", "max_tokens"),
    ("max_tokens zero", "/v1/completions", completions(max_tokens=0), {}, 400, "greater than", "max_tokens"),
    ("max_tokens negative", "/v1/completions", completions(max_tokens=-5), {}, 400, "greater than", "max_tokens"),
    ("max_tokens huge", "/v1/completions", completions(max_tokens=10**9), {}, 400,
     "maximum context length is 320 tokens", "max_tokens"),
    ("prompt over the context", "/v1/completions", completions(prompt="word " * 400), {}, 400,
     "maximum context length is 320 tokens", "max_tokens"),
    ("temperature negative", "/v1/completions", completions(temperature=-1), {}, 400, "greater than",
     "temperature"),
    ("top_p zero", "/v1/completions", completions(top_p=0), {}, 400, "greater than", "top_p"),
    ("top_p above one", "/v1/completions", completions(top_p=1.5), {}, 400, "less than", "top_p"),
    ("top_k below -1", "/v1/completions", completions(top_k=-3), {}, 400, "greater than", "top_k"),
    ("n zero", "/v1/completions", completions(n=0), {}, 400, "greater than", "n"),
    ("n over the cap", "/v1/completions", completions(n=100), {}, 400, "at most 16", "n"),
    ("too many prompts", "/v1/completions", completions(prompt=["a"] * 65), {}, 400, "at most 64", "prompt"),
    ("logprobs over the engine max", "/v1/completions", completions(logprobs=50), {}, 400, "max_logprobs",
     "logprobs"),
    ("seed not an int", "/v1/completions", completions(seed="x"), {}, 400, "integer", "seed"),
    ("stop wrong type", "/v1/completions", completions(stop=5), {}, 400, "stop", "stop"),
    ("empty stop string", "/v1/completions", completions(stop=[""]), {}, 400, "stop", "stop"),
    ("unknown model", "/v1/completions", completions(model="gpt-9"), {}, 404, "does not exist", "model"),
    ("lone surrogate in the prompt", "/v1/completions", escaped(completions(prompt="\ud800abc")), {}, 400,
     "lone surrogate", "prompt"),
    ("lone surrogate in a prompt list", "/v1/completions", escaped(completions(prompt=["ok", "x\udfff"])), {}, 400,
     "lone surrogate", "prompt"),
    ("lone surrogate in stop", "/v1/completions", escaped(completions(stop=["\ud800"])), {}, 400, "lone surrogate",
     "stop"),
    ("lone surrogate in a message", "/v1/chat/completions",
     escaped(chat(messages=[{"role": "user", "content": "hi \ud83d"}])), {}, 400, "lone surrogate",
     "messages[0].content"),
    ("lone surrogate to tokenize", "/tokenize", escaped({"model": "tiny", "prompt": "\ud800"}), {}, 400,
     "lone surrogate", "prompt"),
    ("logit_bias key not a token id", "/v1/completions", completions(logit_bias={"ka": 10}), {}, 400, "token ids",
     "logit_bias"),
    ("logit_bias value too large", "/v1/completions", completions(logit_bias={"5": 500}), {}, 400, "[-100, 100]",
     "logit_bias"),
    ("logit_bias outside the vocabulary", "/v1/completions", completions(logit_bias={"99999": 1}), {}, 400,
     "vocabulary", "logit_bias"),
    ("logit_bias too long", "/v1/completions", completions(logit_bias={str(i): 1 for i in range(301)}), {}, 400,
     "at most 300", "logit_bias"),
    ("presence_penalty above 2", "/v1/completions", completions(presence_penalty=5), {}, 400, "less than",
     "presence_penalty"),
    ("frequency_penalty below -2", "/v1/completions", completions(frequency_penalty=-3), {}, 400, "greater than",
     "frequency_penalty"),
    ("repetition_penalty zero", "/v1/completions", completions(repetition_penalty=0), {}, 400, "greater than",
     "repetition_penalty"),
    ("min_tokens above max_tokens", "/v1/completions", completions(min_tokens=5), {}, 400, "max_tokens",
     "min_tokens"),
    ("empty allowed_token_ids", "/v1/completions", completions(allowed_token_ids=[]), {}, 400, "non-empty",
     "allowed_token_ids"),
    ("allowed_token_ids outside the vocabulary", "/v1/completions", completions(allowed_token_ids=[5, 10**6]), {},
     400, "vocabulary", "allowed_token_ids"),
    ("empty bad word", "/v1/completions", completions(bad_words=[" "]), {}, 400, "non-empty", "bad_words"),
    ("bad word too long", "/v1/completions", completions(bad_words=["ka lo mi ne ru ta shi po ve zu an el"]), {},
     400, "tokens long", "bad_words"),
    ("NaN penalty", "/v1/completions", b'{"model": "tiny", "prompt": "a", "presence_penalty": NaN}', {}, 400,
     "presence_penalty", "presence_penalty"),
    ("best_of above n", "/v1/completions", completions(best_of=3), {}, 400, "best_of", "best_of"),
    ("suffix", "/v1/completions", completions(suffix="end"), {}, 400, "suffix", "suffix"),
    ("prompt_logprobs over the engine max", "/v1/completions", completions(prompt_logprobs=30), {}, 400,
     "max_logprobs", "prompt_logprobs"),
    ("echo with logprobs over the engine max", "/v1/completions", completions(echo=True, logprobs=30), {}, 400,
     "max_logprobs", "logprobs"),
    ("stream_options without stream", "/v1/completions", completions(stream_options={"include_usage": True}),
     {}, 400, "stream", "stream_options"),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), {}, 400, "empty", "messages"),
    ("message without role", "/v1/chat/completions", chat(messages=[{"content": "hi"}]), {}, 400, "role",
     "messages.0.role"),
    ("unknown role", "/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400,
     "role", "messages.0.role"),
    ("image content part", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), {}, 400,
     "text content", "messages[0].content"),
    ("tool parameters not a schema", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "one"}}}]),
     {}, 400, "not a valid JSON Schema", "tools"),
    ("duplicate tool names", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), {}, 400, "twice", "tools"),
    ("tool_choice of an unknown function", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), {}, 400, "not among", "tool_choice"),
    ("response_format of an unknown type", "/v1/chat/completions", chat(response_format={"type": "xml"}), {}, 400,
     "json_schema", "response_format"),
    ("json schema valid JSON but no schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"required": "all"}}}),
     {}, 400, "not a valid JSON Schema", "response_format"),
    ("empty choice list", "/v1/completions", completions(structured_outputs={"choice": []}), {}, 400,
     "non-empty list", "structured_outputs"),
    ("regex that cannot compile", "/v1/completions", completions(guided_regex="a{2,1}"), {}, 400,
     "cannot be compiled", "guided_regex"),
    ("NaN in a schema", "/v1/completions",
     b'{"model": "tiny", "prompt": "a", "guided_json": {"type": "number", "maximum": NaN}}', {}, 400,
     "holds NaN", "guided_json"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), {}, 400, "logprobs",
     "top_logprobs"),
    ("max_completion_tokens huge", "/v1/chat/completions", chat(max_completion_tokens=5000), {}, 400,
     "maximum context length is 320 tokens", "max_completion_tokens"),
    ("detokenize out of vocab", "/detokenize", {"tokens": [1, 99999]}, {}, 400, "vocabulary", "tokens"),
    ("tokenize with neither field", "/tokenize", {"model": "tiny"}, {}, 400, "exactly one", "prompt"),
    # Bounds: each value a request could use to break the step of others is refused at the door.
    ("temperature Infinity", "/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": Infinity}', {},
     400, "holds Infinity", "temperature"),
    ("temperature out of range", "/v1/completions", completions(temperature=1e39), {}, 400, "[0, 100]",
     "temperature"),
    ("NaN in an unknown field", "/v1/completions", b'{"model": "tiny", "prompt": "a", "x": [1, NaN]}', {}, 400,
     "holds NaN", "x"),
    ("top_k past int32", "/v1/completions", completions(top_k=10**20), {}, 400, "top_k", "top_k"),
    ("stop id out of vocab", "/v1/completions", completions(stop_token_ids=[10**6], min_tokens=1), {}, 400,
     "outside the vocabulary", "stop_token_ids"),
    ("too many stop strings", "/v1/completions", completions(stop=[f"s{i}" for i in range(40)]), {}, 400,
     "at most 32", "stop"),
    ("tool schema nested 100 deep", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": deep_schema(100)}}]), {}, 400,
     "nested deeper than 64", "tools"),
    ("body nested past the parser", "/v1/completions", b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", {},
     400, "not valid JSON", None),
    ("too many tools", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), {}, 400,
     "at most 128", "tools"),
    ("missing api key", "/v1/completions", GOOD, {"Authorization": ""}, 401, "API key", None),
    ("wrong api key", "/v1/completions", GOOD, {"Authorization": "Bearer nope"}, 401, "API key", None),
    ("key without Bearer", "/v1/models", None, {"Authorization": KEY}, 401, "API key", None),
    ("tokenize without the key", "/tokenize", {"prompt": "a"}, {"Authorization": ""}, 401, "API key", None),
    ("detokenize without the key", "/detokenize", {"tokens": [1]}, {"Authorization": ""}, 401, "API key", None),
    ("oversized body", "/v1/completions", completions(prompt="x" * 70_000), {}, 413, "exceeds", None),
    ("unknown route", "/v1/embeddings", GOOD, {}, 404, "Not Found", None),
    ("wrong method", "/v1/completions", None, {}, 405, "Method Not Allowed", None),
]


@pytest.fixture(scope="module", params=["one engine", pytest.param("replicas", marks=pytest.mark.slow)])
def server(request, checkpoints, tmp_path_factory):
    """The single-engine server, and the replicated one (two engines behind Ray Serve)."""
    limits = dict(api_key=KEY, max_body_bytes=64 * 1024)
    if request.param == "replicas":
        with replicated_server(str(tmp_path_factory.mktemp("ray")), checkpoints["llama"],
                               tiny_engine_options(device="cpu"), cluster_nodes=[{"TPU": 2}], **limits) as url:
            yield url
        return
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    with live_server(engine, **limits) as (url, _):
        yield url


def send(url: str, path: str, body, headers) -> httpx.Response:
    headers = dict(AUTH, **headers)
    if body is None:
        return httpx.get(url + path, headers=headers)
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers=dict(headers, **{"Content-Type": "application/json"}))
    return httpx.post(url + path, json=body, headers=headers)


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name,path,body,headers,status,words,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_a_clear_error_and_the_server_goes_on(server, name, path, body, headers, status, words,
                                                               param):
    response = send(server, path, body, headers)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert error["param"] == param, error
    assert "Traceback" not in response.text and 'File "' not in response.text
    good = send(server, "/v1/completions", GOOD, {})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_unknown_fields_are_accepted(server):
    response = send(server, "/v1/completions", completions(some_future_field={"a": 1}, user="u1"), {})
    assert response.status_code == 200


def test_health_and_metrics_need_no_key_and_v1_rejects_without_one(server):
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/metrics").status_code == 200
    assert httpx.get(server + "/v1/models").status_code == 401
    assert json.loads(httpx.get(server + "/v1/models", headers=AUTH).text)["data"][0]["id"] == "tiny"
