"""LoRA adapters on the replicated server (Ray Serve, two engine replicas), read by HTTP
clients: an adapter named in ``model`` gives the offline engine's tokens with it, one loaded at
run time serves from every replica, and an adapter's requests without a shared prefix go to
the replica its last request went to."""
from __future__ import annotations

import os
import shutil

import httpx
import pytest

from tests.common import mixed_prompts, replicated_server, tiny_engine_options
from tests.tpu_executor.entrypoints.test_server_replicas import routed, wait_for_health
from tpu_executor import LLM, LoRARequest, SamplingParams
from tpu_executor.tools.lora_adapter import write_random_lora_adapter

pytestmark = pytest.mark.slow  # a Ray cluster, Serve and engine replicas

PROMPTS = mixed_prompts(6, 6, 30, vocab=500, seed=11)  # no two share a 16-token block


@pytest.fixture(scope="module")
def adapters(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("replica_adapters")
    return [write_random_lora_adapter(checkpoints["llama"], str(root / f"a{i}"), rank=8, seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoints, adapters):
    options = tiny_engine_options(device="cpu", enable_lora=True, max_loras=2)
    with replicated_server(str(tmp_path_factory.mktemp("ray")), checkpoints["llama"], options,
                           cluster_nodes=[{"TPU": 2}], lora_modules=(("first", adapters[0]),),
                           enable_lora_runtime_updates=True, lora_adapter_root=os.path.dirname(adapters[0])) as url:
        wait_for_health(url, "ok")
        yield url


def offline_texts(checkpoint, adapter: str):
    llm = LLM(checkpoint, enable_lora=True, **tiny_engine_options(device="cpu"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=LoRARequest("x", 1, adapter))
    llm.shutdown()
    return [o.outputs[0].text for o in outputs]


def complete(url: str, model: str, prompt) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


def test_adapters_serve_from_the_replicas_and_route_to_where_they_went(served, checkpoints, adapters):
    for model, path in (("first", adapters[0]), ("second", adapters[1])):
        if model == "second":  # loaded at run time: every replica reads it when a request needs it
            response = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": model, "lora_path": path},
                                  timeout=60)
            assert response.status_code == 200, response.text
        before = routed(served, "adapter")
        texts = [complete(served, model, prompt) for prompt in PROMPTS]
        assert texts == offline_texts(checkpoints["llama"], path)
        # The first request of an adapter goes to the least busy replica, the others follow it.
        assert routed(served, "adapter") - before == len(PROMPTS) - 1
    base = complete(served, "tiny", PROMPTS[0])
    assert base != complete(served, "first", PROMPTS[0])  # the adapter changes the output


def test_an_adapter_a_replica_cannot_read_fails_its_requests_not_the_replica(served, checkpoints, adapters):
    gone = write_random_lora_adapter(checkpoints["llama"], os.path.join(os.path.dirname(adapters[0]), "gone"), rank=8)
    loaded = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": "gone"}, timeout=60)
    assert loaded.status_code == 200, loaded.text  # the ingress read it
    shutil.rmtree(gone)  # before any replica does
    body = {"model": "gone", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    failed = httpx.post(served + "/v1/completions", json=body, timeout=120)
    assert failed.status_code == 500
    assert failed.json()["error"]["message"] == ("the engine failed this request: the LoRA adapter 'gone' cannot be "
                                                 "read on the replica serving this request")
    assert complete(served, "first", PROMPTS[0])  # the replicas serve on
    wait_for_health(served, "ok")
