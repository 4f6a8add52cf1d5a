"""The plug points' protocols hold for every implementation the project has: the async engine
and the replica pool (``EngineClient``), the in-process core and the core process
(``CoreClient``), the worker and its stand-ins (``WorkerLike``); the stand-ins run through
them."""
import asyncio
import importlib
import inspect

import pytest

from tpu_executor.bench import host as bench_host
from tpu_executor.bench.null_model import NullModelWorker
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.engine.async_engine import AsyncLLMEngine
from tpu_executor.engine.options import build_engine_config
from tpu_executor.engine.protocols import CoreClient, EngineClient
from tpu_executor.executor import WorkerLike
from tpu_executor.tuning.replay import NullWorker, replay
from tpu_executor.tuning.traces import TraceRequest


def protocol_methods(protocol):
    return {name for name, value in vars(protocol).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))}


@pytest.mark.parametrize("protocol, implementations", [
    (EngineClient, ["tpu_executor.engine.async_engine.AsyncLLMEngine",
                    "tpu_executor.entrypoints.ray_serve.replicas.ReplicaPool"]),
    (CoreClient, ["tpu_executor.engine.core.EngineCore", "tpu_executor.engine.core_process.CoreProcess"]),
    (WorkerLike, ["tpu_executor.worker.worker.Worker", "tpu_executor.tuning.replay.NullWorker",
                  "tpu_executor.bench.null_model.NullModelWorker"]),
])
def test_every_implementation_has_every_method_with_its_parameters(protocol, implementations):
    """Checked on the classes' signatures (the replica pool's module imports Ray Serve)."""
    for dotted in implementations:
        module, name = dotted.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        for method in protocol_methods(protocol):
            assert hasattr(cls, method), f"{name} lacks {protocol.__name__}.{method}"
            wanted = getattr(protocol, method)
            if inspect.isfunction(wanted):
                got = inspect.signature(getattr(cls, method))
                assert list(inspect.signature(wanted).parameters)[:len(got.parameters)] == \
                    list(got.parameters)[:len(inspect.signature(wanted).parameters)], (name, method)
                assert inspect.iscoroutinefunction(wanted) == inspect.iscoroutinefunction(getattr(cls, method)), \
                    (name, method, "async")


def test_the_tuners_null_worker_runs_a_replay_through_the_core_client(checkpoints):
    config = build_engine_config(checkpoints["llama"], device="cpu", max_model_len=128, max_num_seqs=4)
    assert isinstance(NullWorker(config, vocab_size=100, num_blocks=64), WorkerLike)
    result = replay(config, [TraceRequest(20, 5), TraceRequest(70, 3)], vocab_size=100)
    assert result.output_tokens == 8 and result.stats.num_running == 0


def test_the_benchs_null_model_serves_a_request_through_both_clients():
    engine = bench_host.engine_for(bench_host.tiny_checkpoint(), num_seqs=2, steps=2, device="cpu")
    worker = engine.core.executor.workers[0]
    assert type(worker) is NullModelWorker and isinstance(worker, WorkerLike)
    assert isinstance(engine.core, CoreClient)
    client = AsyncLLMEngine(engine)
    assert isinstance(client, EngineClient)

    async def serve_one():
        client.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            client.validate_prompt([5, 6, 7], params)
            deltas = [delta async for delta in client.add_request("r", [5, 6, 7], params)]
            return deltas, await client.stats_by_engine(), await client.health_report()
        finally:
            await client.shutdown()

    deltas, stats, health = asyncio.run(serve_one())
    assert sum(len(c.token_ids) for d in deltas for c in d.outputs) == 4 and deltas[-1].finished
    assert list(stats) == [""] and stats[""].num_running == 0 and health == {"status": "ok"}
