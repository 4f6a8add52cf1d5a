"""A fault soak against a live server: 500 requests over the base model and three LoRA adapters
(two device slots, so adapters take turns and are read again), with a draft model speculating.
While they run, one adapter's weight file is removed and put back, a NaN adapter is offered at
the load route, the drafter raises once and a fifth of the streams are cancelled. Every request
not itself at fault gives the tokens of a clean run; the server serves on; no KV block or adapter
slot is left held."""
from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest
from safetensors.torch import load_file, save_file

from tests.common import live_server, tiny_engine_options
from tpu_executor import LLM, LoRARequest, SamplingParams
from tpu_executor.core.lora import WEIGHTS_FILE
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.tools.lora_adapter import write_random_lora_adapter

pytestmark = pytest.mark.slow
NUM_REQUESTS = 500
ADAPTERS = ("a0", "a1", "a2")
FLAKY = "a2"  # its weight file disappears for a while
CONCURRENCY = 16


def soak_requests(seed: int = 0):
    """(prompt ids, adapter name or None, max_tokens, cancelled) for every request."""
    rng = random.Random(seed)
    return [([rng.randrange(3, 500) for _ in range(rng.randrange(4, 40))], rng.choice((None,) + ADAPTERS),
             rng.randrange(4, 12), rng.random() < 0.2) for _ in range(NUM_REQUESTS)]


def write_nan_adapter(checkpoint: str, out_dir: str) -> None:
    write_random_lora_adapter(checkpoint, out_dir, rank=4, seed=9)
    file = os.path.join(out_dir, WEIGHTS_FILE)
    tensors = load_file(file)
    name = next(n for n in sorted(tensors) if n.endswith("lora_B.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file)


@pytest.fixture(scope="module")
def adapter_root(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("soak_adapters")
    for i, name in enumerate(ADAPTERS):
        write_random_lora_adapter(checkpoints["llama"], str(root / name), rank=8, seed=i)
    write_nan_adapter(checkpoints["llama"], str(root / "nan"))
    return root


def clean_tokens(checkpoint: str, root, requests):
    """Each request's greedy tokens from an offline engine that meets no fault."""
    llm = LLM(checkpoint, enable_lora=True, max_loras=3, **tiny_engine_options(device="cpu"))
    loras = {name: LoRARequest(name, i + 1, str(root / name)) for i, name in enumerate(ADAPTERS)}
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, _, n, _ in requests]
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt, _, _, _ in requests], params,
                               use_tqdm=False, lora_request=[loras.get(name) for _, name, _, _ in requests])
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outputs]


class DrafterFault:
    """Wraps a worker's drafter so that its ``call``-th draft raises."""

    def __init__(self, drafter, call: int):
        self.drafter, self.call, self.calls, self.raised = drafter, call, 0, False
        self.draft = self._draft

    def _draft(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.call:
            self.raised = True
            raise RuntimeError("drafter fell over")
        return self.drafter.draft(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.drafter, name)


async def one_request(client: httpx.AsyncClient, request) -> dict:
    """A completion's token ids, or its error, or 'cancelled' (a stream dropped after its first
    chunk)."""
    prompt, adapter, max_tokens, cancelled = request
    body = {"model": adapter or "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": cancelled}
    if not cancelled:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return {"error": response.json()["error"]["message"]}
        return {"tokens": response.json()["choices"][0]["token_ids"]}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for _ in response.aiter_lines():
            break
    return {"cancelled": True}


async def run_soak(url: str, requests, on_progress) -> list:
    """Every request, ``CONCURRENCY`` at a time; ``on_progress(done)`` after each."""
    results, done, queue = [None] * len(requests), 0, asyncio.Queue()
    for index in range(len(requests)):
        queue.put_nowait(index)

    async def client_loop(client):
        nonlocal done
        while not queue.empty():
            index = queue.get_nowait()
            results[index] = await one_request(client, requests[index])
            done += 1
            await on_progress(client, done)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(CONCURRENCY)))
    return results


def test_faults_hurt_only_the_requests_at_fault(checkpoints, adapter_root):
    requests = soak_requests()
    want = clean_tokens(checkpoints["llama"], adapter_root, requests)
    engine = LLMEngine.from_options(checkpoints["llama"], enable_lora=True, max_loras=2, max_cpu_loras=2,
                                    speculative_config={"method": "draft_model", "model": checkpoints["llama"],
                                                        "num_speculative_tokens": 3},
                                    **tiny_engine_options(device="cpu"))
    worker = engine.core.executor.workers[0]
    worker.drafter = fault = DrafterFault(worker.drafter, call=40)
    weights = str(adapter_root / FLAKY / WEIGHTS_FILE)
    events = {}

    async def on_progress(client, done):
        if done == 100:
            os.rename(weights, weights + ".gone")
        elif done == 150:
            response = await client.post("/v1/load_lora_adapter", json={"lora_name": "nan", "lora_path": "nan"})
            events["nan"] = response
        elif done == 250:
            os.rename(weights + ".gone", weights)

    modules = tuple((name, str(adapter_root / name)) for name in ADAPTERS)
    with live_server(engine, lora_modules=modules, enable_lora_runtime_updates=True,
                     lora_adapter_root=str(adapter_root)) as (url, async_engine):
        results = asyncio.run(run_soak(url, requests, on_progress))
        after = httpx.post(url + "/v1/completions", json={"model": "a1", "prompt": requests[0][0], "max_tokens": 4,
                                                          "temperature": 0, "ignore_eos": True,
                                                          "return_token_ids": True})
        core = engine.core
        assert core.scheduler.adapters.slots_in_use == 0
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_usable_blocks
        core.kv_cache.check_invariants()

    assert fault.raised
    assert events["nan"].status_code == 400 and "finite" in events["nan"].json()["error"]["message"]
    assert after.status_code == 200
    failed = [(request, result) for request, result in zip(requests, results) if "error" in result]
    assert failed, "the removed weight file never had to be read: the soak tested nothing of it"
    assert all(request[1] == FLAKY and FLAKY in result["error"] for request, result in failed), failed[:3]
    assert str(adapter_root) not in " ".join(result["error"] for _, result in failed)
    completed = [(result["tokens"], expected) for result, expected in zip(results, want) if "tokens" in result]
    assert len(completed) >= 0.7 * NUM_REQUESTS
    assert [tokens for tokens, _ in completed] == [expected for _, expected in completed]
