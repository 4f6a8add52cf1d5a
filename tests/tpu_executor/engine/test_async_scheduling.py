"""Asynchronous scheduling changes nothing a user sees: the same tokens, text, log-probs and
finish reasons as the synchronous engine, through chunked prefill, preemption, stops, n > 1 and
abort."""
import pytest

from tests.common import assert_same_outputs_over_random_requests, preempting_llm_pair, run_to_end
from tpu_executor import SamplingParams
from tpu_executor.core.request import accumulate_deltas


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(synchronous, asynchronous) native engines that preempt and chunk prompts."""
    with preempting_llm_pair(checkpoints["llama"], "async_scheduling") as pair:
        yield pair


def test_async_outputs_equal_sync_outputs_over_200_random_requests(engines):
    sync, asynchronous = engines
    assert_same_outputs_over_random_requests(sync, asynchronous)
    assert sync.stats().num_preemptions > 0 and asynchronous.stats().num_preemptions > 0


def test_async_abort_mid_generation_returns_blocks_and_keeps_the_others(engines):
    sync, asynchronous = engines
    expected = sync.generate({"prompt_token_ids": [7, 8, 9]}, SamplingParams(temperature=0, max_tokens=20,
                                                                                ignore_eos=True), use_tqdm=False)
    engine = asynchronous.engine
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    doomed = engine.add_request({"prompt_token_ids": [5, 6, 7]}, greedy)
    kept = engine.add_request({"prompt_token_ids": [7, 8, 9]}, greedy)
    deltas = engine.step() + engine.step() + engine.step()
    engine.abort_request(doomed)
    deltas += run_to_end(engine)
    totals = accumulate_deltas(deltas)
    assert totals[doomed].outputs[0].finish_reason == "abort"
    assert totals[kept].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()


def test_a_finished_request_computes_at_most_one_discarded_token(engines):
    """EOS is only known when the token is read back: the step already started decodes once
    more for that request; its token is dropped, and max_tokens never schedules one too many."""
    _, asynchronous = engines
    engine = asynchronous.engine
    before = engine.stats().padding.decode_rows_real
    outputs = asynchronous.generate({"prompt_token_ids": [5, 6, 7]},
                                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 10
    # One prefill token, then exactly nine decodes: none beyond max_tokens.
    assert engine.stats().padding.decode_rows_real - before == 9
