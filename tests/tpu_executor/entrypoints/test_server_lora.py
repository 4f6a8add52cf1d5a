"""A server with LoRA adapters, read by the ``openai`` client: the ``model`` field selects an
adapter (its tokens equal the offline engine's with that adapter), ``/v1/models`` lists base and
adapters, an adapter loaded at run time serves until it is unloaded (then a 404), an unknown
model is a 404 in OpenAI's shape, and a bad adapter is a 400 after which the server serves on."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.common import live_server, tiny_engine_options
from tpu_executor import LLM, LoRARequest, SamplingParams
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.tools.lora_adapter import write_random_lora_adapter
from tpu_executor.worker.lora_loader import lora_layers

PROMPT = [5, 17, 33, 101, 250, 7, 9, 64]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory):
    return tmp_path_factory.mktemp("server_adapters")


@pytest.fixture(scope="module")
def adapters(checkpoints, adapter_root):
    return [write_random_lora_adapter(checkpoints["llama"], str(adapter_root / f"a{i}"), rank=8, seed=i)
            for i in range(2)]


@pytest.fixture(scope="module")
def expected(checkpoints, adapters):
    """Each adapter's (and the base's) greedy tokens from the offline engine."""
    llm = LLM(checkpoints["llama"], enable_lora=True, **tiny_engine_options(device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    requests = [None] + [LoRARequest(f"a{i}", i + 1, path) for i, path in enumerate(adapters)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(requests), params, use_tqdm=False,
                           lora_request=requests)
    llm.shutdown()
    return [o.outputs[0].text for o in outputs]


@pytest.fixture(scope="module")
def engine(checkpoints):
    return LLMEngine.from_options(checkpoints["llama"], enable_lora=True, max_loras=2,
                                  **tiny_engine_options(device="cpu"))


@pytest.fixture(scope="module")
def served(engine, adapters, adapter_root):
    with live_server(engine, lora_modules=(("first", adapters[0]),), enable_lora_runtime_updates=True,
                     lora_adapter_root=str(adapter_root)) as (url, _):
        yield url


def slot_is_empty(engine, slot: int) -> bool:
    """Whether every adapter layer of the worker's model holds zeros in ``slot``."""
    model = engine.core.executor.workers[0].model
    return all(not layer.lora_a[slot].any() and not layer.lora_b[slot].any() for layer in lora_layers(model))


def complete(client, model):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_the_model_field_selects_an_adapter(served, expected):
    client = openai.OpenAI(base_url=served + "/v1", api_key="none")
    assert complete(client, "tiny") == expected[0]
    assert complete(client, "first") == expected[1]
    stream = client.completions.create(model="first", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in stream) == expected[1]
    assert [m.id for m in client.models.list().data] == ["tiny", "first"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(client, "nobody")


def test_an_adapter_loaded_at_run_time_serves_until_unloaded(served, engine, expected, adapters, adapter_root):
    client = openai.OpenAI(base_url=served + "/v1", api_key="none")
    loaded = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": adapters[1]})
    assert loaded.status_code == 200, loaded.text
    assert complete(client, "second") == expected[2]
    again = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": adapters[1]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    (adapter_root / "empty").mkdir(exist_ok=True)
    bad = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "empty"})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == ("LoRA adapter 'empty' has no adapter_config.json: not a PEFT adapter "
                                              "directory")
    assert complete(client, "first") == expected[1]  # the server serves on
    slot = engine.core.scheduler.adapters.slot_of(served_id(engine, "second"))
    assert slot is not None and not slot_is_empty(engine, slot)
    assert httpx.post(served + "/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
    complete(client, "tiny")  # the workers empty the slot with the next step
    assert slot_is_empty(engine, slot)
    with pytest.raises(openai.NotFoundError):
        complete(client, "second")
    gone = httpx.post(served + "/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert gone.status_code == 404


def test_metrics_count_requests_and_tokens_per_adapter(served):
    client = openai.OpenAI(base_url=served + "/v1", api_key="none")
    before = scrape(served)
    complete(client, "first")
    after = scrape(served)
    key = 'tpu_executor:lora_requests_total{lora_name="first"}'
    tokens = 'tpu_executor:lora_generation_tokens_total{lora_name="first"}'
    assert after[key] == before.get(key, 0) + 1
    assert after[tokens] == before.get(tokens, 0) + 10
    assert "tpu_executor:lora_slots_in_use" in after


def served_id(engine, name: str) -> int:
    """The adapter id the engine's slots know ``name`` by."""
    holders = engine.core.scheduler.adapters.holders
    return next(lora.lora_int_id for lora in holders if lora is not None and lora.lora_name == name)


def scrape(url):
    lines = httpx.get(url + "/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if not line.startswith("#")}
