"""Streaming step outputs on the native path: ``step()`` hands out one delta per request that
advanced, and the deltas of every sample concatenate to exactly the final output (text, ids,
log-probs), with stop strings (held back until they can no longer be cut), ``n > 1`` and
log-probs; ``LLM.generate`` (which asks for ``FINAL_ONLY`` outputs) returns the same outputs."""
import time
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from tests.common import run_to_end, tiny_engine_options
from tpu_executor import LLM, RequestOutputKind, SamplingParams

# The third prompt repeats the first: it meets the same stop string (and hits the prefix cache).
PROMPTS = [list(range(5, 40)), list(range(60, 150)), list(range(5, 40)), [7] * 30]


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(checkpoints["llama"], device="cpu", **tiny_engine_options())


def _params(stop_text: str):
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text, "zzzz"]),
            SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, n=3, seed=11, logprobs=3),
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0,
                           stop=[stop_text], include_stop_str_in_output=True),
            SamplingParams(temperature=1.0, top_k=20, max_tokens=12, ignore_eos=True, seed=3, n=2)]


def _stop_text(llm) -> str:
    """Four characters from the middle of the first prompt's greedy text: a stop string that
    the greedy run will meet, likely across a token boundary."""
    full = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=24,
                                                                          ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    stop = text[len(text) // 2:][:4]
    assert len(stop) == 4 and stop.strip(), f"the random model's text is too short: {text!r}"
    return stop


def test_deltas_concatenate_to_the_final_outputs(llm):
    stop = _stop_text(llm)
    params = _params(stop)
    expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(PROMPTS, params)]
    text, tokens, logprobs = defaultdict(str), defaultdict(list), defaultdict(list)
    finished_at, steps_seen = {}, defaultdict(int)
    for step, delta in enumerate(run_to_end(engine)):
        assert delta.request_id not in finished_at, "a delta after the request's last one"
        steps_seen[delta.request_id] += 1
        for completion in delta.outputs:
            key = (delta.request_id, completion.index)
            text[key] += completion.text
            tokens[key] += completion.token_ids
            logprobs[key] += completion.logprobs or []
        if delta.finished:
            finished_at[delta.request_id] = step
    assert sorted(finished_at) == sorted(ids)
    for request_id, final in zip(ids, expected):
        assert steps_seen[request_id] > 3, "a request must stream over several steps"
        for completion in final.outputs:
            key = (request_id, completion.index)
            assert (text[key], tokens[key]) == (completion.text, completion.token_ids), key
            # Same tokens at every position; log-probs within float noise: this run reads the
            # prompts from the prefix cache, so its prefills have other shapes than the first's.
            streamed, whole = logprobs[key], completion.logprobs or []
            assert [sorted(step) for step in streamed] == [sorted(step) for step in whole], key
            torch.testing.assert_close([[step[t] for t in sorted(step)] for step in streamed],
                                       [[step[t] for t in sorted(step)] for step in whole], rtol=0, atol=1e-5)
    first, parallel, included = expected[0].outputs[0], expected[1], expected[2].outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == stop and stop not in first.text
    assert included.finish_reason == "stop" and included.text.endswith(stop)
    assert len(parallel.outputs) == 3 and all(len(c.logprobs) == len(c.token_ids) for c in parallel.outputs)
    assert engine.stats().kv_blocks_used == 0


def test_final_only_requests_hand_out_each_sample_once_at_its_end(llm):
    params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in _params(_stop_text(llm))]
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(PROMPTS, params)]
    deltas = list(run_to_end(engine))
    for request_id, sp in zip(ids, params):
        mine = [d for d in deltas if d.request_id == request_id]
        samples = [c.index for d in mine for c in d.outputs]
        assert sorted(samples) == list(range(sp.n)), "each sample exactly once"
        assert all(c.finish_reason is not None for d in mine for c in d.outputs), "only finished samples"
        assert mine[-1].finished and not any(d.finished for d in mine[:-1])
    # The whole outputs equal the streamed ones (checked against deltas in the test above).
    expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for request_id, final in zip(ids, expected):
        got = {c.index: c for d in deltas if d.request_id == request_id for c in d.outputs}
        for completion in final.outputs:
            streamed = got[completion.index]
            assert (streamed.text, streamed.token_ids) == (completion.text, completion.token_ids)
            assert got[completion.index].logprobs == completion.logprobs
    assert engine.stats().kv_blocks_used == 0


def test_tokens_stream_one_per_step(llm):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": PROMPTS[1]},
                                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    deltas = [d for d in run_to_end(engine) if d.request_id == request_id]
    assert [len(d.outputs[0].token_ids) for d in deltas] == [1] * 10
    assert [d.finished for d in deltas] == [False] * 9 + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_a_final_only_output_carries_the_engines_first_token_time(llm):
    """The server times a request that does not stream from its one output: the first token's
    time must be when the engine read it back, several steps before that output."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    request_id = engine.add_request({"prompt_token_ids": PROMPTS[1]}, params)
    step_ends, outputs = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        step_ends.append(time.monotonic())
    (final,) = [d for d in outputs if d.request_id == request_id]
    metrics = final.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    # Six tokens come back one per step: the first at least five steps before the last.
    assert len(step_ends) >= 6 and metrics.first_token_time <= step_ends[-6]


def test_abort_hands_out_a_last_delta(llm):
    engine = llm.engine
    request_id = engine.add_request({"prompt_token_ids": PROMPTS[0]},
                                    SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=2))
    # Three steps: with asynchronous scheduling a step's tokens come out one call later.
    streamed = engine.step() + engine.step() + engine.step()
    engine.abort_request(request_id)
    last = [d for d in run_to_end(engine) if d.request_id == request_id]
    assert len(last) == 1 and last[0].finished
    assert [c.finish_reason for c in last[0].outputs] == ["abort", "abort"]
    assert sum(len(c.token_ids) for d in streamed for c in d.outputs) >= 2
    assert engine.stats().kv_blocks_used == 0
