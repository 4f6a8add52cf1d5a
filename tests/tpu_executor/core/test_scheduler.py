"""Scheduler behaviour with a fake model: batching limits, preemption by recompute, abort."""
import random

import pytest

from tpu_executor.core.config import SchedulerConfig
from tpu_executor.core.kv_cache_manager import KVCacheManager
from tpu_executor.core.request import Request, RequestStatus
from tpu_executor.core.sampling_params import SamplingParams
from tpu_executor.core.scheduler import Scheduler
from tpu_executor.core.step import SampledTokens

BLOCK = 4


def make_scheduler(num_blocks, max_num_seqs=8, max_tokens_per_step=64, chunked=True, prefix_caching=True,
                   max_model_len=10_000):
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    config = SchedulerConfig(max_num_seqs, max_tokens_per_step, enable_chunked_prefill=chunked)
    return Scheduler(config, kv, max_model_len=max_model_len, max_chunk_tokens=max_tokens_per_step), kv


def make_request(rid, prompt_len, max_tokens, first=1):
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0)


def next_token(request):
    # A deterministic "model": the next token depends on everything before it.
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % 97


def run_to_completion(scheduler, kv, requests, max_steps=2000, running=()):
    table = {r.request_id: r for r in (*requests, *running)}
    for r in requests:
        scheduler.add(r)
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return
        out = scheduler.schedule()
        assert len(out.prefills) + len(out.decodes) <= scheduler.config.max_num_seqs
        # Without chunking a prompt over the budget runs whole, alone with the decodes.
        over = 0 if scheduler.config.enable_chunked_prefill else 1
        scheduled = sum(len(p.token_ids) for p in out.prefills[over:]) + len(out.decodes)
        assert scheduled <= scheduler.config.max_num_batched_tokens
        assert len({w.request_id for w in out.prefills + out.decodes}) == len(out.prefills) + len(out.decodes)
        _, finished = scheduler.update(fake_model_tokens(out, table), table)
        assert all(r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == r.max_outputs
                   for r in finished)
        kv.check_invariants()
    raise AssertionError("scheduler did not finish")


def fake_model_tokens(out, table):
    """The fake model's token for every sampled request of the step ``out``."""
    ids = [w.request_id for w in out.prefills + out.decodes if getattr(w, "is_last_chunk", True)]
    return SampledTokens(ids, [next_token(table[i]) for i in ids], [0.0] * len(ids))


def expected_outputs(prompt_len, max_tokens, first=1):
    request = make_request("x", prompt_len, max_tokens, first)
    while len(request.output_token_ids) < max_tokens:
        request.output_token_ids.append(next_token(request))
    return request.output_token_ids


@pytest.mark.parametrize("budget,chunked", [(64, False), (64, True), (9, True)])
def test_preemption_by_recompute_loses_nothing(budget, chunked):
    rng = random.Random(0)
    specs = [(rng.randint(3, 20), rng.randint(1, 30)) for _ in range(12)]
    # far fewer blocks than needed; a budget of 9 cuts most prompts into chunks
    scheduler, kv = make_scheduler(num_blocks=14, max_num_seqs=6, max_tokens_per_step=budget, chunked=chunked)
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
    scheduler, _ = make_scheduler(num_blocks=64, max_num_seqs=8, max_tokens_per_step=20, chunked=False)
    for i in range(4):
        scheduler.add(make_request(str(i), 8, 4))
    out = scheduler.schedule()
    assert len(out.prefills) == 2  # 8 + 8 tokens fit in 20, a third would not


def test_chunked_prefill_fills_the_budget_with_a_chunk():
    # (equal prompts: without prefix caching, or the fourth would start from the third's blocks)
    scheduler, _ = make_scheduler(num_blocks=64, max_num_seqs=8, max_tokens_per_step=20, prefix_caching=False)
    for i in range(4):
        scheduler.add(make_request(str(i), 8, 4))
    out = scheduler.schedule()
    assert [len(w.token_ids) for w in out.prefills] == [8, 8, 4]
    assert [w.is_last_chunk for w in out.prefills] == [True, True, False]
    out = scheduler.schedule()  # the third prompt's rest comes first, then the fourth
    assert [(w.request_id, w.start_pos, len(w.token_ids)) for w in out.prefills] == [("2", 4, 4), ("3", 0, 8)]


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


EOS = 2


@pytest.mark.parametrize("outputs,params,max_model_len,expected", [
    ([5, 6, EOS, 7], dict(max_tokens=50), 10_000, ("stop", None, 3)),
    ([5, 6, EOS, 7], dict(max_tokens=50, ignore_eos=True), 10_000, (None, None, 4)),
    ([5, 6, 7], dict(stop_token_ids=[6]), 10_000, ("stop", 6, 2)),
    ([5, 6, 7, 8], dict(max_tokens=3), 10_000, ("length", None, 3)),
    ([5, EOS, 7], dict(ignore_eos=True, stop_token_ids=[EOS]), 10_000, ("stop", EOS, 2)),  # asked for: named
    ([5, 6, 7, 8, 9], dict(max_tokens=50), 6, ("length", None, 4)),  # the context ends before max_tokens
])
def test_update_finishes_on_eos_stop_ids_and_length(outputs, params, max_model_len, expected):
    """The scheduler ends a request on its EOS (unless ignored), a stop id (named as the stop
    reason), max_tokens, or the end of the context; a token after the end is discarded."""
    scheduler, kv = make_scheduler(num_blocks=16, max_model_len=max_model_len)
    request = Request("r", [1, 1], SamplingParams(**params), seed=0, eos_token_id=EOS)
    scheduler.add(request)
    for token in outputs:
        scheduler.schedule()
        kept, finished = scheduler.update(SampledTokens(["r"], [token], [0.0]), {"r": request})
        assert len(kept) == 1 and finished == ([request] if request.is_finished else [])
        if request.is_finished:
            break
    assert (request.status.finish_reason, request.stop_reason, len(request.output_token_ids)) == expected
    kept, finished = scheduler.update(SampledTokens(["r"], [9], [0.0]), {"r": request})
    assert (len(kept), finished) == ((0, []) if request.is_finished else (1, []))
    if request.is_finished:
        assert kv.num_free_blocks == kv.num_usable_blocks


def step_sync(scheduler, table):
    """One synchronous step with the fake model; returns the scheduled work."""
    out = scheduler.schedule()
    scheduler.update(fake_model_tokens(out, table), table)
    return out


def test_a_long_prompt_is_chunked_while_running_requests_decode_every_step():
    scheduler, kv = make_scheduler(num_blocks=64, max_tokens_per_step=16)
    short, long = make_request("short", 5, 50, first=100), make_request("long", 61, 3)
    table = {"short": short, "long": long}
    scheduler.add(short)
    step_sync(scheduler, table)
    scheduler.add(long)
    chunks = []
    while not long.output_token_ids:
        out = step_sync(scheduler, table)
        assert [w.request_id for w in out.decodes] == ["short"]  # never stalls
        chunks += [(w.start_pos, len(w.token_ids), w.is_last_chunk) for w in out.prefills]
    # 15 tokens a step (the decode takes one of 16), the last chunk alone is sampled
    assert chunks == [(0, 15, False), (15, 15, False), (30, 15, False), (45, 15, False), (60, 1, True)]
    assert long.output_token_ids == expected_outputs(61, 1)
    kv.check_invariants()


def test_abort_between_chunks_returns_blocks():
    scheduler, kv = make_scheduler(num_blocks=64, max_tokens_per_step=8)
    request = make_request("long", 40, 4)
    scheduler.add(request)
    out = step_sync(scheduler, {"long": request})
    assert not out.prefills[0].is_last_chunk and request.is_prefilling
    scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished()
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants()


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prompts_share_their_finished_blocks(prefix_caching):
    scheduler, kv = make_scheduler(num_blocks=64, max_tokens_per_step=8, prefix_caching=prefix_caching)
    first, second = make_request("a", 30, 2), make_request("b", 30, 2)
    table = {"a": first, "b": second}
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(3):  # 8 tokens a step: "b" waits for the budget
        assert [w.request_id for w in step_sync(scheduler, table).prefills] == ["a"]
    out = step_sync(scheduler, table)
    # the last chunk of "a" caches the 4 blocks before its previous chunk (whose step has
    # finished even when scheduling runs ahead) before "b" is admitted in the same step
    assert {w.request_id: w.start_pos for w in out.prefills} == {"a": 24, "b": 16 if prefix_caching else 0}
    run_to_completion(scheduler, kv, [], running=[first, second])
    assert first.output_token_ids == second.output_token_ids == expected_outputs(30, 2)


def test_a_chunk_never_preempts_a_request_already_scheduled_in_the_step():
    kv = KVCacheManager(6, BLOCK)  # 5 usable blocks
    config = SchedulerConfig(8, 64)
    scheduler = Scheduler(config, kv, max_model_len=10_000, max_chunk_tokens=8)
    a, b, c = make_request("a", 3, 50, first=100), make_request("b", 20, 2), make_request("c", 3, 50, first=200)
    table = {"a": a, "b": b, "c": c}
    scheduler.add(a)
    step_sync(scheduler, table)
    scheduler.add(b)
    scheduler.add(c)
    out = step_sync(scheduler, table)  # a decodes, b's first chunk of 8, c admitted after b
    assert [(w.request_id, w.is_last_chunk) for w in out.prefills] == [("b", False), ("c", True)]
    out = scheduler.schedule()  # a and c decode; b's next chunk finds no free block
    assert [w.request_id for w in out.decodes] == ["a", "c"] and not out.prefills
    # b gave way, not c (the last admitted, whose decode is already in the step)
    assert b.status is RequestStatus.WAITING and c.status is RequestStatus.RUNNING
    assert set(kv.block_ids("c")) >= set(out.decodes[1].block_ids)
    kv.check_invariants()


def test_a_new_adapter_is_read_ahead_while_other_work_runs():
    """With work running, a request whose adapter nobody has read waits one step while the
    workers read it (``lora_reads``), and runs from the next (``lora_loads``); with nothing
    else to run it is admitted at once; an adapter read before is not read again."""
    from tpu_executor.core.lora import LoRARequest

    kv = KVCacheManager(64, BLOCK, False)
    scheduler = Scheduler(SchedulerConfig(8, 64), kv, max_model_len=1000, max_chunk_tokens=64, max_loras=2)
    first, second = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    requests = {r.request_id: r for r in [
        Request("r0", [1, 2, 3], SamplingParams(max_tokens=20), seed=0, lora_request=first),
        Request("r1", [4, 5, 6], SamplingParams(max_tokens=20), seed=0, lora_request=second),
        Request("r2", [7, 8, 9], SamplingParams(max_tokens=20), seed=0)]}
    for request in requests.values():
        scheduler.add(request)
    out = scheduler.schedule()  # nothing runs yet: r0's adapter is read now; r1's waits for it
    assert [w.request_id for w in out.prefills] == ["r0", "r2"]
    assert [lora.lora_int_id for _, lora in out.lora_loads] == [1] and out.lora_reads == (second,)
    scheduler.update(fake_model_tokens(out, requests), requests)
    out = scheduler.schedule()
    assert [w.request_id for w in out.prefills] == ["r1"] and out.lora_reads == ()
    assert [(slot, lora.lora_int_id) for slot, lora in out.lora_loads] == [(2, 2)]
    scheduler.update(fake_model_tokens(out, requests), requests)
    late = Request("r3", [1, 1, 1], SamplingParams(max_tokens=2), seed=0, lora_request=first)
    requests["r3"] = late
    scheduler.add(late)
    out = scheduler.schedule()  # adapter 1 is in its slot: no read, no load
    assert "r3" in [w.request_id for w in out.prefills] and out.lora_reads == () and out.lora_loads == ()


def test_a_failed_adapter_write_empties_its_slot_and_a_later_request_reads_it_again():
    """The workers could not write adapter a into slot 1: its requests in that step and those
    admitted since fail, the slot is emptied (a (1, None) load with the next step that runs),
    a is no longer counted as read, so a later request reads and loads it again."""
    from tpu_executor.core.lora import LoRARequest

    kv = KVCacheManager(64, BLOCK, False)
    scheduler = Scheduler(SchedulerConfig(8, 64), kv, max_model_len=1000, max_chunk_tokens=64, max_loras=1)
    a = LoRARequest("a", 1, "/adapters/a")
    requests = {r.request_id: r for r in [
        Request("base", [1, 2, 3], SamplingParams(max_tokens=30), seed=0),
        Request("r0", [4, 5, 6], SamplingParams(max_tokens=20), seed=0, lora_request=a)]}
    for request in requests.values():
        scheduler.add(request)
    assert scheduler.schedule().lora_reads == (a,)  # the base runs; r0 waits for a's read
    failed_step = scheduler.schedule()
    assert failed_step.lora_loads == ((1, a),) and [w.request_id for w in failed_step.prefills] == ["r0"]
    late = Request("r1", [7, 8, 9], SamplingParams(max_tokens=20), seed=0, lora_request=a)
    requests["r1"] = late
    scheduler.add(late)
    in_flight = scheduler.schedule()  # r1 joins slot 1 before the failure is known
    assert [w.request_id for w in in_flight.prefills] == ["r1"] and in_flight.lora_loads == ()
    assert scheduler.adapter_failed(1, a.lora_int_id, failed_step) == ["r0", "r1"]
    for rid in ("r0", "r1"):
        scheduler.finish(requests[rid], RequestStatus.FINISHED_ERROR)
    assert scheduler.adapters.holders[1] is None and scheduler.adapters.users[1] == 0
    again = Request("r2", [1, 1, 1], SamplingParams(max_tokens=2), seed=0, lora_request=a)
    requests["r2"] = again
    scheduler.add(again)
    out = scheduler.schedule()  # the slot is emptied on every rank; a is read again, r2 waits for it
    assert out.lora_loads == ((1, None),) and out.lora_reads == (a,)
    assert "r2" not in [w.request_id for w in out.prefills]
    out = scheduler.schedule()
    assert out.lora_loads == ((1, a),) and [w.request_id for w in out.prefills] == ["r2"]


def test_unloading_an_adapter_empties_its_slot_once_its_requests_end():
    """``forget`` while a request runs with the adapter: no new request joins its slot, and the
    slot is emptied when the request ends; its (1, None) waits for a step that runs."""
    from tpu_executor.core.lora import LoRARequest

    kv = KVCacheManager(64, BLOCK, False)
    scheduler = Scheduler(SchedulerConfig(8, 64), kv, max_model_len=1000, max_chunk_tokens=64, max_loras=1)
    a = LoRARequest("a", 1, "/adapters/a")
    running = Request("r0", [4, 5, 6], SamplingParams(max_tokens=20), seed=0, lora_request=a)
    scheduler.add(running)
    assert scheduler.schedule().lora_loads == ((1, a),)
    assert not scheduler.adapters.forget(a.lora_int_id)
    assert scheduler.adapters.slot_of(a.lora_int_id) is None and scheduler.adapters.holders[1] == a
    scheduler.finish(running, RequestStatus.FINISHED_ABORTED)
    assert scheduler.adapters.holders[1] is None
    assert scheduler.schedule().is_empty  # nothing runs: the slot's emptying waits
    scheduler.add(Request("base", [1, 2, 3], SamplingParams(max_tokens=2), seed=0))
    assert scheduler.schedule().lora_loads == ((1, None),)
