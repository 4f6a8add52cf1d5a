"""Serving over a simulated two-host Ray cluster (tp=2, one rank per host): HTTP greedy outputs
equal the same engine's offline ones; killing a worker ends open streams with an error and
turns /health into 503 within 60 s."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import ray

from tests.common import live_server, mixed_prompts, ray_session, run_to_end, tensor_parallel_options
from tests.tpu_executor.entrypoints.test_server_load import stream_completion
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # a simulated two-node Ray cluster


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    with ray_session(str(tmp_path_factory.mktemp("ray")), cluster_nodes=[{"TPU": 1}, {"TPU": 1}]) as cluster:
        yield cluster


def test_serving_over_two_hosts_then_losing_a_worker(two_hosts, checkpoints):
    engine = LLMEngine.from_options(checkpoints["llama"], device="cpu", tensor_parallel_size=2,
                                    ray_address=two_hosts.address, **tensor_parallel_options())
    nodes = engine.core.executor.node_ids()
    assert nodes[0] != nodes[1]
    prompts = mixed_prompts(4, 5, 40, vocab=512, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, greedy) for p in prompts]
    offline = accumulate_deltas(run_to_end(engine))
    expected = [offline[i].outputs[0].text for i in ids]

    async def serve_then_kill(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"model": "tiny", "prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            response = (await client.post("/v1/completions", json=body)).json()
            texts = [c["text"] for c in sorted(response["choices"], key=lambda c: c["index"])]
            long = {"model": "tiny", "prompt": prompts[0], "max_tokens": 88, "ignore_eos": True}
            streams = [asyncio.ensure_future(stream_completion(client, long)) for _ in range(2)]
            await asyncio.sleep(0.5)
            ray.kill(engine.core.executor.actors[1])
            killed = time.monotonic()
            ended = await asyncio.gather(*streams)
            while (await client.get("/health")).status_code != 503:
                assert time.monotonic() - killed < 60
                await asyncio.sleep(0.5)
            return texts, ended, time.monotonic() - killed

    with live_server(engine) as (url, _):
        texts, ended, seconds = asyncio.run(serve_then_kill(url))
    assert texts == expected
    assert all(error is not None and "worker rank 1" in error for _, _, error in ended), ended
    assert seconds < 60
