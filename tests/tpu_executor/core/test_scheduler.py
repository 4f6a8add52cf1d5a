"""Scheduler behaviour with a fake model: batching limits, preemption by recompute, abort."""
import random

from tpu_executor.core.config import SchedulerConfig
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.core.scheduler import Scheduler
from tpu_executor.core.step import SampledToken

BLOCK = 4


def make_scheduler(num_blocks, max_num_seqs=8, max_tokens_per_step=64):
    kv = KVCacheManager(num_blocks, BLOCK)
    return Scheduler(SchedulerConfig(max_num_seqs, max_tokens_per_step), kv, max_model_len=10_000), kv


def make_request(rid, prompt_len, max_tokens):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), seed=0)


def next_token(request):
    # A deterministic "model": the next token depends on everything before it.
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % 97


def run_to_completion(scheduler, kv, requests, max_steps=2000):
    table = {r.request_id: r for r in requests}
    for r in requests:
        scheduler.add(r)
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        out = scheduler.schedule()
        assert len(out.prefills) + len(out.decodes) <= scheduler.config.max_num_seqs
        assert sum(len(p.token_ids) for p in out.prefills[1:]) + len(out.decodes) <= scheduler.config.max_num_batched_tokens
        sampled = {w.request_id: SampledToken(next_token(table[w.request_id]), 0.0)
                   for w in out.prefills + out.decodes}
        for request in scheduler.update(sampled, table):
            if len(request.output_token_ids) >= request.sampling_params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        kv.check_invariants()
    raise AssertionError("scheduler did not finish")


def expected_outputs(prompt_len, max_tokens):
    request = make_request("x", prompt_len, max_tokens)
    while len(request.output_token_ids) < max_tokens:
        request.output_token_ids.append(next_token(request))
    return request.output_token_ids


def test_preemption_by_recompute_loses_nothing():
    rng = random.Random(0)
    specs = [(rng.randint(3, 20), rng.randint(1, 30)) for _ in range(12)]
    scheduler, kv = make_scheduler(num_blocks=14, max_num_seqs=6)  # far fewer blocks than needed
    requests = [make_request(str(i), p, m) for i, (p, m) in enumerate(specs)]
    run_to_completion(scheduler, kv, requests)
    assert sum(r.num_preemptions for r in requests) > 0, "the test must exercise preemption"
    for request, (p, m) in zip(requests, specs):
        assert request.output_token_ids == expected_outputs(p, m)
    assert kv.num_free_blocks == kv.num_usable_blocks


def test_max_num_seqs_bounds_the_running_batch():
    scheduler, kv = make_scheduler(num_blocks=64, max_num_seqs=3)
    for i in range(7):
        scheduler.add(make_request(str(i), 5, 4))
    out = scheduler.schedule()
    assert len(out.prefills) == 3 and len(scheduler.waiting) == 4


def test_token_budget_limits_prefills_per_step():
    scheduler, _ = make_scheduler(num_blocks=64, max_num_seqs=8, max_tokens_per_step=20)
    for i in range(4):
        scheduler.add(make_request(str(i), 8, 4))
    out = scheduler.schedule()
    assert len(out.prefills) == 2  # 8 + 8 tokens fit in 20, a third would not


def test_abort_at_any_point_returns_blocks():
    scheduler, kv = make_scheduler(num_blocks=32)
    running, waiting = make_request("run", 9, 10), make_request("wait", 9, 10)
    scheduler.add(running)
    scheduler.schedule()
    scheduler.add(waiting)
    scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    scheduler.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants()


def test_prefix_cache_hit_skips_computed_tokens():
    scheduler, kv = make_scheduler(num_blocks=32)
    first = make_request("a", 10, 1)
    run_to_completion(scheduler, kv, [first])
    second = make_request("b", 10, 1)
    scheduler.add(second)
    out = scheduler.schedule()
    assert out.prefills[0].start_pos == 8 and len(out.prefills[0].token_ids) == 2
