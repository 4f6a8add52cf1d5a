"""The in-process executor runs every worker call on its step thread, which ends with it: torch's
CPU ops then have one OpenMP team (two teams on two cores cost the native asynchronous engine
10-14%, see ``UniprocExecutor``)."""
from __future__ import annotations

import threading

import pytest

from tests.common import engine_with_worker, mixed_prompts, run_to_end, tiny_engine_options
from tpu_executor import SamplingParams

RECORDED = ("init_device", "load_model", "init_cache", "warmup", "launch_step", "collect_step", "execute_model",
            "stats", "close")


def recording_worker_class(calls):
    """A Worker that appends (method, thread id) to ``calls`` for each call of ``RECORDED``."""
    from tpu_executor.worker.worker import Worker

    def recorder(name):
        def method(self, *args, **kwargs):
            calls.append((name, threading.get_ident()))
            return getattr(Worker, name)(self, *args, **kwargs)
        return method

    return type("RecordingWorker", (Worker,), {name: recorder(name) for name in RECORDED})


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_worker_call_runs_on_one_step_thread_that_ends_with_the_engine(checkpoints, async_scheduling):
    calls = []
    engine = engine_with_worker(checkpoints["llama"], recording_worker_class(calls),
                                **tiny_engine_options(device="cpu", async_scheduling=async_scheduling))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for prompt in mixed_prompts(3, 5, 20, vocab=512, seed=3):
        engine.add_request({"prompt_token_ids": prompt}, params)
    assert len(run_to_end(engine)) > 0
    engine.stats()
    engine.shutdown()
    step = "launch_step" if async_scheduling else "execute_model"
    assert {"init_device", "load_model", "init_cache", "warmup", step, "stats", "close"} <= {n for n, _ in calls}
    threads = {thread for _, thread in calls}
    assert len(threads) == 1 and threading.get_ident() not in threads
    assert not [t for t in threading.enumerate() if t.name.startswith("tpu-executor-step")]
