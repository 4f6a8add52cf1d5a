"""A server with n-gram speculative decoding, read by the ``openai`` client: streamed and whole
greedy completions equal those of an engine without speculation (several tokens may arrive in
one delta), and /metrics counts drafts and accepted tokens under vLLM's names."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.engine.llm_engine import LLMEngine

# Text that repeats itself: the drafter finds its n-grams.
PROMPTS = ["a b c d a b c d a b c d a b", "one two three one two three one two", "x y z x y z x y z x y"]


@pytest.fixture(scope="module")
def served(checkpoints):
    """(base URL, expected texts) of a speculative server, and the plain engine's texts."""
    plain = LLM(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].text for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    plain.shutdown()
    engine = LLMEngine.from_options(checkpoints["llama"], speculative_config='{"method": "ngram", '
                                    '"num_speculative_tokens": 3, "prompt_lookup_min": 1}',
                                    **tiny_engine_options(device="cpu"))
    with live_server(engine) as (url, _):
        yield url, expected


def scrape(url):
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if not line.startswith("#")}


def test_streamed_and_whole_completions_equal_the_plain_engine(served):
    url, expected = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    request = dict(model="tiny", temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt=PROMPTS, **request)
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.completion_tokens == 24 * len(PROMPTS)
    for prompt, text in zip(PROMPTS, expected):
        pieces = [p.choices[0].text for p in client.completions.create(prompt=prompt, stream=True, **request)
                  if p.choices]
        assert "".join(pieces) == text


def test_metrics_count_drafts_and_accepted_tokens(served):
    url, _ = served
    metrics = scrape(url)
    drafts, accepted = (metrics[f"tpu_executor:spec_decode_num_{name}_total"] for name in ("drafts", "accepted_tokens"))
    assert drafts > 0 and accepted > 0
    assert metrics["tpu_executor:spec_decode_num_draft_tokens_total"] >= accepted
    per_position = {k: v for k, v in metrics.items()
                    if k.startswith("tpu_executor:spec_decode_num_accepted_tokens_per")}
    assert 'tpu_executor:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in per_position
    assert sum(per_position.values()) == accepted
