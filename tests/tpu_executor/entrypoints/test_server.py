"""The OpenAI-compatible server, read by the official ``openai`` client over loopback: greedy
outputs equal the offline engine's on the same prompts; streaming, ``n``, logprobs, stop
strings, usage, the side routes, metrics, and disconnects freeing KV blocks."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch

from tests.common import live_server, run_to_end, tiny_engine_options
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.engine.llm_engine import LLMEngine

PROMPTS = ["the quick brown fox", "lorem ipsum dolor", "a b c d e f", "tpu executor serves"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is a tpu"}]
KEY = "test-key"


def offline(engine: LLMEngine, prompts, params: SamplingParams):
    """Outputs of the engine itself (no server), in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = accumulate_deltas(run_to_end(engine))
    return [outputs[i] for i in ids]


def chat_prompt(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return {"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]}


@pytest.fixture(scope="module")
def served(checkpoints):
    """(base URL, async engine, offline references) of a server over a tiny Llama."""
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    refs = {
        "greedy": offline(engine, PROMPTS, greedy),
        "logprobs": offline(engine, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                                ignore_eos=True)),
        "seeded_n3": offline(engine, PROMPTS[:1], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=8,
                                                                 ignore_eos=True)),
        "chat": offline(engine, [chat_prompt(engine.tokenizer, CHAT)], greedy),
        "processed": offline(engine, PROMPTS, SamplingParams(temperature=0, max_tokens=12, **PROCESSING)),
    }
    with live_server(engine, api_key=KEY) as (url, async_engine):
        yield url, async_engine, refs


# Every logits-processing field a client sends (OpenAI's and vLLM's extras), as the engine takes them.
PROCESSING = dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 8.0, 30: -50.0},
                  min_tokens=4, bad_words=["lo"], allowed_token_ids=list(range(3, 300)))


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def completion_text(client, **kwargs):
    return client.completions.create(model="tiny", temperature=0, extra_body={"ignore_eos": True}, **kwargs)


def test_greedy_completions_equal_the_offline_engine(client, served):
    refs = served[2]["greedy"]
    response = completion_text(client, prompt=PROMPTS, max_tokens=12)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in refs]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert response.usage.completion_tokens == 12 * len(PROMPTS)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_logits_processing_fields_give_the_offline_engines_tokens(client, served):
    refs = served[2]["processed"]
    body = dict(PROCESSING, logit_bias={str(k): v for k, v in PROCESSING["logit_bias"].items()})
    response = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=12, temperature=0, presence_penalty=body.pop("presence_penalty"),
        frequency_penalty=body.pop("frequency_penalty"), logit_bias=body.pop("logit_bias"), extra_body=body)
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [r.outputs[0].text for r in refs]
    unprocessed = completion_text(client, prompt=PROMPTS, max_tokens=12)
    assert [c.text for c in unprocessed.choices] != [c.text for c in response.choices]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, checkpoints):
    """What evaluation harnesses send: the prompt's log-probs (the first None), then the
    completion's, whole and streamed; vLLM's prompt_logprobs beside them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoints["llama"])(PROMPTS[0])["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()
    expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [None] + [expected[i - 1, ids[i]].item() for i in range(1, len(ids))]
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True,
                                      logprobs=1, extra_body={"ignore_eos": True, "prompt_logprobs": 0})
    streamed = list(completion_text(client, prompt=PROMPTS[0], max_tokens=3, echo=True, logprobs=1, stream=True))
    for logprobs in (whole.choices[0].logprobs, streamed[0].choices[0].logprobs):
        got = logprobs.token_logprobs[:len(ids)]
        assert got[0] is None and logprobs.top_logprobs[0] is None
        torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(expected[1:]), atol=1e-4, rtol=0)
        assert len(logprobs.token_logprobs) == len(ids) + (3 if logprobs is whole.choices[0].logprobs else 1)
    vllm_style = whole.choices[0].model_extra["prompt_logprobs"]
    assert vllm_style[0] is None and vllm_style[1][str(ids[1])]["logprob"] == pytest.approx(expected[1], abs=1e-4)


def test_token_id_prompts_equal_text_prompts(client, served):
    refs = served[2]["greedy"]
    response = completion_text(client, prompt=[r.prompt_token_ids for r in refs[:2]], max_tokens=12)
    assert [c.text for c in response.choices] == [r.outputs[0].text for r in refs[:2]]
    single = completion_text(client, prompt=refs[0].prompt_token_ids, max_tokens=12)
    assert single.choices[0].text == refs[0].outputs[0].text


def test_streamed_completion_adds_up_to_the_whole_one(client, served):
    refs = served[2]["greedy"]
    chunks = list(completion_text(client, prompt=PROMPTS[:2], max_tokens=12, stream=True,
                                  stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [r.outputs[0].text for r in refs[:2]]
    finishes = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert finishes == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_continuous_usage_stats_put_usage_in_every_chunk(client, served):
    chunks = list(completion_text(client, prompt=PROMPTS[:1], max_tokens=12, stream=True,
                                  stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert all(chunk.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for chunk in chunks)
    assert counts == sorted(counts) and counts[-1] == 12 and len(counts) > 2


def test_chat_whole_and_streamed_equal_the_offline_engine(client, served):
    expected = served[2]["chat"][0].outputs[0].text
    response = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == expected
    assert response.usage.prompt_tokens == len(served[2]["chat"][0].prompt_token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_default_max_tokens_fills_the_context(client, served):
    response = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0,
                                              extra_body={"ignore_eos": True})
    prompt_tokens = response.usage.prompt_tokens
    assert response.usage.completion_tokens == 320 - prompt_tokens  # max_model_len of the engine
    assert response.choices[0].finish_reason == "length"


def test_seeded_n_samples_equal_the_offline_engine(client, served):
    ref = served[2]["seeded_n3"][0]
    response = client.completions.create(model="tiny", prompt=PROMPTS[0], n=3, temperature=0.9, seed=11,
                                         max_tokens=8, extra_body={"ignore_eos": True})
    by_index = {c.index: c.text for c in response.choices}
    assert by_index == {o.index: o.text for o in ref.outputs}


def test_logprobs_equal_the_offline_engine(client, served):
    ref = served[2]["logprobs"][0].outputs[0]
    response = completion_text(client, prompt=PROMPTS[0], max_tokens=6, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert logprobs.token_logprobs == pytest.approx([lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == ref.text
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.logprob - 1e-6 for entry in content)


def test_stop_string_truncates_and_is_reported(client, served):
    text = served[2]["greedy"][0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text
    response = completion_text(client, prompt=PROMPTS[0], max_tokens=12, stop=[stop])
    choice = response.choices[0]
    assert choice.text == text[:text.index(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    streamed = completion_text(client, prompt=PROMPTS[0], max_tokens=12, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_echo_prepends_the_prompt(client, served):
    response = completion_text(client, prompt=PROMPTS[1], max_tokens=12, echo=True)
    assert response.choices[0].text == PROMPTS[1] + served[2]["greedy"][1].outputs[0].text


def test_models_health_tokenize_detokenize(client, served):
    url = served[0]
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(url + "/health").status_code == 200
    auth = {"Authorization": f"Bearer {KEY}"}
    tokens = httpx.post(url + "/tokenize", json={"prompt": PROMPTS[0]}, headers=auth).json()
    assert tokens["tokens"] == served[2]["greedy"][0].prompt_token_ids and tokens["max_model_len"] == 320
    detokenized = httpx.post(url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=auth).json()
    assert detokenized["prompt"].endswith(PROMPTS[0])
    chat = httpx.post(url + "/tokenize", json={"messages": CHAT}, headers=auth).json()
    assert chat["tokens"] == served[2]["chat"][0].prompt_token_ids


def test_metrics_count_tokens_and_requests(client, served):
    def scrape():
        lines = httpx.get(served[0] + "/metrics").text.splitlines()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if not line.startswith("#")}

    before = scrape()
    completion_text(client, prompt=PROMPTS[2], max_tokens=5)
    after = scrape()
    assert after["tpu_executor:generation_tokens_total"] - before["tpu_executor:generation_tokens_total"] == 5
    key = 'tpu_executor:request_success_total{finished_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    assert after["tpu_executor:time_to_first_token_seconds_count"] > before.get(
        "tpu_executor:time_to_first_token_seconds_count", 0)
    assert after["tpu_executor:e2e_request_latency_seconds_count"] >= 1
    assert after["tpu_executor:request_queue_time_seconds_count"] >= 1
    assert after["tpu_executor:num_requests_running"] == 0 and after["tpu_executor:kv_cache_usage_perc"] == 0
    assert "tpu_executor:compilations_after_warmup" in after


def test_metrics_time_streamed_and_whole_requests(client, served):
    """A request that does not stream gets one output (FINAL_ONLY): it adds a first-token time
    and a time per output token, and no inter-token gaps; a streamed one adds a gap per delta
    after its first."""
    def counts():
        lines = httpx.get(served[0] + "/metrics").text.splitlines()
        values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if not line.startswith("#")}
        return {name: values.get(f"tpu_executor:{name}_seconds_count", 0.0)
                for name in ("time_to_first_token", "inter_token_latency", "request_time_per_output_token")}

    def added(before, after):
        return {name: after[name] - before[name] for name in before}

    start = counts()
    text = completion_text(client, prompt=PROMPTS[2], max_tokens=5).choices[0].text
    whole = counts()
    pieces = completion_text(client, prompt=PROMPTS[2], max_tokens=5, stream=True)
    assert "".join(p.choices[0].text for p in pieces if p.choices) == text
    streamed = counts()
    assert added(start, whole) == {"time_to_first_token": 1, "inter_token_latency": 0,
                                   "request_time_per_output_token": 1}
    assert added(whole, streamed) == {"time_to_first_token": 1, "inter_token_latency": 4,
                                      "request_time_per_output_token": 1}


def wait_until_idle(async_engine, timeout_s: float = 10.0) -> None:
    """Until the engine holds no request and no KV block (fails after ``timeout_s``)."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while True:
        stats = asyncio.run_coroutine_threadsafe(async_engine.stats(), async_engine._loop).result(10)
        if stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_the_blocks(served):
    url, async_engine, _ = served
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    wait_until_idle(async_engine)


def test_client_timeout_on_a_whole_response_frees_the_blocks(served):
    url, async_engine, _ = served
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 300, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.3)
    wait_until_idle(async_engine)
