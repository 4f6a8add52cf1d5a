"""The server under load and failure: a full waiting queue answers 503 at once; a dead engine
ends every open stream with an error and turns /health and new requests into 503; a soak of
1,000 requests (a fifth cancelled mid-stream, concurrency above ``max_num_seqs``) leaves every
other request correct and the KV cache empty."""
from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time

import httpx
import pytest

from tests.common import live_server, replica_figures, replicated_server, run_to_end, tiny_engine_options
from tests.tpu_executor.entrypoints.test_server import wait_until_idle
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.executor import WorkerFailure


def tiny_engine(checkpoints, **overrides):
    return LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu", **overrides))


async def stream_completion(client: httpx.AsyncClient, body, cancel_after=None):
    """(text, finish reason, in-band error) of one streamed completion; ``cancel_after``
    chunks closes the connection early (returns None)."""
    text, finish, chunks = "", None, 0
    async with client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as response:
        if response.status_code != 200:
            return None, None, (await response.aread()).decode()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return text, finish, data["error"]["message"]
            text += data["choices"][0]["text"]
            finish = data["choices"][0]["finish_reason"] or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return None
    return text, finish, None


@pytest.mark.parametrize("kind", ["one engine", pytest.param("replicas", marks=pytest.mark.slow)])
def test_a_full_waiting_queue_answers_503_at_once(checkpoints, kind, tmp_path_factory):
    engine = tiny_engine(checkpoints, max_num_seqs=2)
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True}

    async def burst(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            responses = await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(12)])
        return [r.status_code for r in responses], [r.json() for r in responses if r.status_code != 200]

    # Two replicas take 3 requests each and 3 more wait for one: the rest are turned away.
    with soak_server(kind, engine, str(tmp_path_factory.mktemp("ray")), max_waiting_requests=3) as (url, idle):
        statuses, errors = asyncio.run(burst(url))
        idle()
    # At least the queue's worth is admitted (more if the engine moved some to running first).
    assert statuses.count(200) >= 3 and statuses.count(503) >= 1, statuses
    assert set(statuses) == {200, 503}
    assert all("waiting queue is full" in e["error"]["message"] for e in errors)


def test_a_dead_engine_ends_open_streams_and_answers_503(checkpoints):
    engine = tiny_engine(checkpoints)
    real_call = engine.core.executor._run_on_workers
    calls = {"n": 0}

    def failing_after_a_while(method, *args, **kwargs):
        calls["n"] += method in ("launch_step", "execute_model")
        if calls["n"] > 20:
            raise WorkerFailure("rank 0 is gone (simulated)")
        return real_call(method, *args, **kwargs)

    engine.core.executor._run_on_workers = failing_after_a_while
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 250, "ignore_eos": True}

    async def run(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            results = await asyncio.gather(*[stream_completion(client, body) for _ in range(3)])
            health = await client.get("/health")
            new = await client.post("/v1/completions", json=body)
        return results, health, new

    with live_server(engine) as (url, _):
        results, health, new = asyncio.run(run(url))
    assert all(error is not None and "rank 0 is gone" in error for _, _, error in results), results
    assert health.status_code == 503 and "rank 0 is gone" in health.json()["error"]["message"]
    assert new.status_code == 503


@contextlib.contextmanager
def soak_server(kind: str, engine, tmp_dir: str, **server_options):
    """(base URL, a check that every engine is idle) of the single-engine server over
    ``engine``, or of two replicas of its checkpoint and options behind Ray Serve."""
    if kind == "one engine":
        with live_server(engine, **server_options) as (url, async_engine):
            def idle():
                wait_until_idle(async_engine)
                assert async_engine.num_open_requests == 0
                assert not engine.has_unfinished_requests()
            yield url, idle
        return
    engine.shutdown()
    options = tiny_engine_options(device="cpu", max_num_seqs=engine.config.scheduler.max_num_seqs)
    with replicated_server(tmp_dir, engine.config.model.model, options, cluster_nodes=[{"TPU": 2}],
                           **server_options) as url:
        yield url, lambda: wait_until_replicas_idle(url)


def wait_until_replicas_idle(url: str, timeout_s: float = 15.0) -> None:
    """Until every replica reports no request and no KV block in use (they report each second)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(url + "/metrics", timeout=30).text
        figures = {metric: replica_figures(text, metric)
                   for metric in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        busy = {metric: values for metric, values in figures.items() if any(values.values())}
        if len(figures["num_requests_running"]) == 2 and not busy:
            return
        assert time.monotonic() < deadline, busy or text
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one engine", "replicas"])
def test_soak_1000_requests_with_cancellations(checkpoints, kind, tmp_path_factory):
    engine = tiny_engine(checkpoints, max_num_seqs=8)
    rng = random.Random(0)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    outputs = accumulate_deltas(run_to_end(engine))
    expected = [outputs[i].outputs[0].text for i in ids]
    plan = [(rng.randrange(len(prompts)), rng.random() < 0.2, rng.randint(1, 16)) for _ in range(1000)]

    async def one(client, gate, which, cancel, max_tokens):
        body = {"model": "tiny", "prompt": prompts[which], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        async with gate:
            result = await stream_completion(client, body, cancel_after=rng.randint(1, 3) if cancel else None)
        if result is None:
            return "cancelled"
        text, finish, error = result
        assert error is None and finish == "length", (which, result)
        # Greedy text of a shorter run is a prefix of the 16-token reference (same tokens).
        assert expected[which].startswith(text), (which, text, expected[which])
        return "done"

    async def soak(url):
        gate = asyncio.Semaphore(24)  # three times max_num_seqs
        async with httpx.AsyncClient(base_url=url, timeout=120,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*[one(client, gate, *p) for p in plan])

    with soak_server(kind, engine, str(tmp_path_factory.mktemp("ray"))) as (url, idle):
        results = asyncio.run(soak(url))
        idle()
    assert results.count("done") + results.count("cancelled") == 1000
    assert 150 <= results.count("cancelled") <= 250


def test_bench_serve_reads_streamed_and_whole_responses(checkpoints):
    """``bench serve``'s client against a live server: every request completes with the tokens
    it asked for; a streamed one has its first token before its end and a time per output
    token, a whole one (``--no-stream``) only its end-to-end time."""
    from tpu_executor.bench.serve import random_workload, run_load, summarize

    workload = random_workload(6, 12, 8, 0.5, 200, seed=1)
    with live_server(tiny_engine(checkpoints)) as (url, async_engine):
        streamed, seconds = asyncio.run(run_load(url, "tiny", None, workload, float("inf"), 1.0, None, 0))
        whole, _ = asyncio.run(run_load(url, "tiny", None, workload, float("inf"), 1.0, None, 0, stream=False))
        wait_until_idle(async_engine)
    for results in (streamed, whole):
        assert [r.error for r in results] == [""] * 6
        assert [r.output_tokens for r in results] == [n for _, n in workload]
    assert all(0 < r.ttft < r.e2e and r.tpot is not None for r in streamed if r.output_tokens > 1)
    assert all(r.ttft == r.e2e and r.tpot is None and not r.itls for r in whole)
    summary = summarize(whole, seconds, workload, {})
    assert summary["completed"] == 6 and summary["tpot_ms"]["p50"] is None and summary["e2e_ms"]["p50"] > 0
