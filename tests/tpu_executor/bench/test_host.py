"""``bench host``: the empty model step drives the real engine, and every phase is measured."""
import gc
import random
import time

import pytest

from tpu_executor.bench import host as bench_host
from tpu_executor.bench import null_model
from tpu_executor.cli import main
from tpu_executor.core.phase_timer import HOST_PHASES


def test_null_model_engine_generates_the_expected_chain_of_tokens():
    engine = bench_host.engine_for(bench_host.tiny_checkpoint(), num_seqs=8, steps=4, device="cpu")
    try:
        vocab = engine.vocab_size
        [request_id] = bench_host._add_requests(engine, 1, random.Random(0), max_tokens=6)
        prompt = engine._groups[request_id].prompt_token_ids
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [t for delta in engine.step() for c in delta.outputs for t in c.token_ids]
        # Each greedy token is the empty step's function of the token before it.
        expected, last = [], prompt[-1]
        for _ in range(6):
            last = (last * 7919 + 13) % (vocab - 3) + 3
            expected.append(last)
        assert outputs == expected
    finally:
        engine.shutdown()


def test_filling_the_batch_fails_naming_a_request_that_ended(monkeypatch):
    """A request of the endless batch that ends early would leave it short forever."""
    engine = bench_host.engine_for(bench_host.tiny_checkpoint(), num_seqs=4, steps=4, device="cpu")
    add = bench_host._add_requests
    monkeypatch.setattr(bench_host, "_add_requests", lambda e, n, rng, max_tokens, kind: add(e, n, rng, 2, kind))
    try:
        with pytest.raises(RuntimeError, match=r"request \S+ ended while the benchmark's batch was filling \(length"):
            bench_host._fill(engine, 4, random.Random(0))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("output_kind", ["delta", "final_only"])
def test_measure_reports_every_phase_for_decode_and_mixed_steps(output_kind):
    results = bench_host.measure(bench_host.tiny_checkpoint(), num_seqs=16, steps=3, device="cpu",
                                 output_kind=output_kind)
    for kind in ("decode", "mixed"):
        ms = results[kind]
        totals = {"other", "host", "core", "front-end", "device", "median_step", "gc", "gc max"}
        assert set(HOST_PHASES) | totals <= set(ms)
        assert 0 <= ms["gc"] < sum(ms[p] for p in HOST_PHASES) + ms["other"] + ms["device"]
        assert 0 <= ms["gc max"] <= 3 * ms["gc"] + 1e-9  # one collection is at most all 3 steps' worth
        assert ms["schedule"] > 0 and ms["inputs"] > 0 and ms["detokenize"] > 0 and ms["device"] > 0
        assert abs(ms["host"] - sum(ms[p] for p in HOST_PHASES) - ms["other"]) < 1e-9
        # The core's step holds scheduling, inputs and recording tokens; the front-end the text.
        assert ms["schedule"] + ms["inputs"] < ms["core"] < ms["host"] - ms["detokenize"]
        assert abs(ms["core"] + ms["front-end"] - ms["host"]) < 1e-9


def test_gc_clock_counts_collections_only_while_active():
    with bench_host.GcClock() as clock:
        gc.collect()
        gc.collect(0)
    inside = clock.seconds
    gc.collect()
    assert inside > 0 and clock.seconds == inside
    assert 0 < clock.longest <= inside


def test_command_prints_the_table(capsys):
    main(["bench", "host", "--num-seqs", "8", "--steps", "2", "--output-kind", "delta", "final_only"])
    out = capsys.readouterr().out
    assert "| 8 | delta | decode |" in out and "| 8 | delta | mixed |" in out
    assert "| 8 | final_only | decode |" in out


def _greedy_tokens(worker_class, async_scheduling: bool):
    """Each of 3 requests' 6 greedy tokens, in the order they were added."""
    engine = bench_host.engine_for(bench_host.tiny_checkpoint(), num_seqs=8, steps=4, device="cpu",
                                   worker_class=worker_class, async_scheduling=async_scheduling)
    try:
        ids = bench_host._add_requests(engine, 3, random.Random(1), max_tokens=6)
        tokens = {request_id: [] for request_id in ids}
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id] += delta.outputs[0].token_ids
        return [tokens[request_id] for request_id in ids]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_device_gives_the_empty_steps_tokens(async_scheduling):
    expected = _greedy_tokens(null_model.NullModelWorker, async_scheduling=False)
    held = _greedy_tokens(null_model.held_device_worker(1.0), async_scheduling)
    assert held == expected and all(len(tokens) == 6 for tokens in held)


def test_held_device_queues_steps_and_collect_waits_for_each():
    engine = bench_host.engine_for(bench_host.tiny_checkpoint(), num_seqs=8, steps=4, device="cpu",
                                   worker_class=null_model.held_device_worker(20.0))
    try:
        bench_host._add_requests(engine, 2, random.Random(2), max_tokens=8)
        step = engine.core.scheduler.schedule()
        runner = engine.core.executor.workers[0].runner
        first, second = runner.launch(step), runner.launch(step)  # a queue: the second waits for the first
        assert second.done_at - first.done_at == pytest.approx(0.020, abs=1e-6)
        first.collect()
        assert time.perf_counter() >= first.done_at
        second.collect()
        assert time.perf_counter() >= second.done_at
    finally:
        engine.shutdown()


def test_device_ms_prints_the_overlap_table_and_rejects_bad_values(capsys):
    main(["bench", "host", "--num-seqs", "8", "--steps", "3", "--device-ms", "1"])
    assert "| 8 | 1 ms held |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--device-ms takes milliseconds > 0"):
        main(["bench", "host", "--num-seqs", "8", "--device-ms", "0"])
