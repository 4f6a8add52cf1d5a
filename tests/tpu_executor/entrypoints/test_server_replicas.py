"""The replicated server (Ray Serve) over a simulated cluster, read by HTTP clients: greedy
outputs equal one offline engine's; requests spread over the replicas; requests sharing a long
prefix, or a session, stay on one replica and hit its prefix cache; ``bench serve`` loads it as
it is; a replica that dies fails only its own streams, /health says degraded until Serve has
replaced it."""
from __future__ import annotations

import asyncio
import re
import time
from typing import Dict

import httpx
import pytest

from tests.common import mixed_prompts, replica_figures, replicated_server, run_to_end, tiny_engine_options
from tests.tpu_executor.entrypoints.test_server_load import stream_completion
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.slow  # a Ray cluster, Serve and engine replicas

GREEDY = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def offline_texts(checkpoint, prompts, max_tokens=12, **options):
    engine = LLMEngine.from_options(checkpoint, **options)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    outputs = accumulate_deltas(run_to_end(engine))
    engine.shutdown()
    return [outputs[i].outputs[0].text for i in ids]


def by_replica(url: str, metric: str) -> Dict[str, float]:
    """``tpu_executor:<metric>`` of each replica, from /metrics."""
    return replica_figures(httpx.get(url + "/metrics", timeout=30).text, metric)


def routed(url: str, reason: str) -> float:
    found = re.search(rf'^tpu_executor:routed_requests_total{{reason="{reason}"}} (\S+)$',
                      httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(found.group(1)) if found else 0.0


def wait_for_health(url: str, status: str, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(url + "/health", timeout=30)
        report = response.json() if response.status_code == 200 else {"status": "unavailable"}
        if report["status"] == status:
            return report
        assert time.monotonic() < deadline, report
        time.sleep(0.5)


@pytest.fixture(scope="module")
def served(tmp_path_factory, checkpoints):
    with replicated_server(str(tmp_path_factory.mktemp("ray")), checkpoints["llama"],
                           tiny_engine_options(device="cpu"), cluster_nodes=[{"TPU": 2}]) as url:
        wait_for_health(url, "ok")
        yield url


def complete(url: str, prompt, headers=None, **fields):
    response = httpx.post(url + "/v1/completions", json={**GREEDY, "prompt": prompt, **fields},
                          headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_greedy_outputs_equal_offline_and_spread_over_both_replicas(served, checkpoints):
    prompts = mixed_prompts(8, 4, 40, vocab=500, seed=3)
    expected = offline_texts(checkpoints["llama"], prompts, **tiny_engine_options(device="cpu"))
    before = by_replica(served, "prefix_cache_queries_total")

    async def all_at_once():
        async with httpx.AsyncClient(base_url=served, timeout=120) as client:
            return await asyncio.gather(*[client.post("/v1/completions", json={**GREEDY, "prompt": p})
                                          for p in prompts])

    responses = asyncio.run(all_at_once())
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    time.sleep(2.5)  # the replicas publish their stats every second
    after = by_replica(served, "prefix_cache_queries_total")
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(served):
    system = list(range(100, 164))  # four full KV blocks
    hits_before, prefix_before = by_replica(served, "prefix_cache_hits_total"), routed(served, "prefix")
    for i in range(4):
        complete(served, system + [200 + i, 300 + i], max_tokens=2)
    time.sleep(2.5)
    gained = {r: v - hits_before.get(r, 0) for r, v in by_replica(served, "prefix_cache_hits_total").items()}
    assert sorted(gained.values()) == [0, 3 * 64], gained  # the last three found all four blocks
    assert routed(served, "prefix") - prefix_before == 3


def test_a_session_stays_on_one_replica(served):
    queries_before, session_before = by_replica(served, "prefix_cache_queries_total"), routed(served, "session")
    for i in range(4):
        complete(served, [7 + i, 9, 11 + i], headers={"X-Session-Id": "conversation-1"}, max_tokens=2)
    complete(served, [5, 6, 7], user="conversation-1", max_tokens=2)  # the body's `user` names it too
    time.sleep(2.5)
    gained = {r: v - queries_before.get(r, 0) for r, v in by_replica(served, "prefix_cache_queries_total").items()}
    assert sorted(gained.values()) == [0, 4 * 3 + 3], gained
    assert routed(served, "session") - session_before == 4


def test_bench_serve_loads_the_replicated_server_unchanged(served):
    from tpu_executor.bench.serve import random_workload, run_load, summarize

    workload = random_workload(8, 12, 6, 0.5, 400, seed=2)
    results, seconds = asyncio.run(run_load(served, "tiny", None, workload, float("inf"), 1.0, None, 0))
    summary = summarize(results, seconds, workload, {})
    assert summary["completed"] == 8 and summary["failed"] == 0
    assert [r.output_tokens for r in results] == [n for _, n in workload]


async def replicas_running_requests(client: httpx.AsyncClient, timeout_s: float = 15.0):
    """The replicas that report requests running, once two do (they report each second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = replica_figures((await client.get("/metrics")).text, "num_requests_running")
        busy = [replica for replica, count in running.items() if count > 0]
        if len(busy) == 2 or time.monotonic() > deadline:
            return busy
        await asyncio.sleep(0.2)


def test_a_dead_replica_fails_its_own_streams_and_is_replaced(served):
    import ray

    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 300, "ignore_eos": True}

    async def stream_then_kill():
        async with httpx.AsyncClient(base_url=served, timeout=120) as client:
            streams = []
            for _ in range(4):  # one at a time, so that the least busy replica alternates
                streams.append(asyncio.ensure_future(stream_completion(client, body)))
                await asyncio.sleep(0.3)
            busy = await replicas_running_requests(client)
            assert len(busy) == 2, f"the streams did not spread over both replicas: {busy}"
            victim = next(a for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["name"].endswith("#" + busy[0]))
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            return await asyncio.gather(*streams)

    ended = asyncio.run(stream_then_kill())
    failed = [error for _, _, error in ended if error is not None]
    finished = [text for text, finish, error in ended if error is None and finish == "length"]
    assert failed and finished, ended
    assert all("replica" in error for error in failed), failed
    assert wait_for_health(served, "degraded")["replicas_serving"] == 1
    assert wait_for_health(served, "ok", timeout_s=180)["replicas_serving"] == 2
    assert complete(served, [1, 2, 3], max_tokens=4)["choices"][0]["finish_reason"] == "length"


def test_a_draining_ingress_answers_503_and_lets_its_streams_finish(served):
    """What SIGTERM asks of the ingress first (the last test here: the ingress stays draining)."""
    from ray import serve

    body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 200, "ignore_eos": True}

    async def drain_during_a_stream():
        async with httpx.AsyncClient(base_url=served, timeout=120) as client:
            stream = asyncio.ensure_future(stream_completion(client, body))
            await asyncio.sleep(1.0)
            await serve.get_app_handle("tpu_executor").drain.remote()
            refused = await client.post("/v1/completions", json=dict(body, max_tokens=2))
            health = await client.get("/health")
            return await stream, refused, health

    (_, finish, error), refused, health = asyncio.run(drain_during_a_stream())
    assert error is None and finish == "length"
    assert refused.status_code == health.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
