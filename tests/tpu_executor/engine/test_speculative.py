"""Speculative decoding with n-gram drafts on the native path changes nothing a user sees: the
same tokens, text, log-probs and finish reasons as decoding one token at a time, through
chunked prefill, preemption, prefix caching, stop strings and ``max_tokens`` landing inside an
accepted run, n > 1 and every sampling feature (requests that cannot speculate decode beside
those that do). The compiled paths' counterpart is in test_engine.py."""
import pytest

from tests.common import assert_same_outputs_over_random_requests, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.core.speculative import SpeculativeConfig
from tpu_executor.engine.drafter import ngram_drafts

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repeating_prompts(count: int, period: int = 7, length: int = 40):
    """Prompts that repeat a short random phrase: n-gram drafts hit on them."""
    import random

    rng = random.Random(5)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 500) for _ in range(period)]
        prompts.append({"prompt_token_ids": (phrase * (length // period + 1))[:length]})
    return prompts


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(plain, speculative) native engines with a small KV cache (requests get preempted) and a
    token budget of 64 (longer prompts run as chunks)."""
    options = tiny_engine_options(device="cpu", num_blocks=60, block_size=16, max_num_batched_tokens=64)
    pair = [LLM(model=checkpoints["llama"], **options),
            LLM(model=checkpoints["llama"], speculative_config=NGRAM, **options)]
    yield pair
    for llm in pair:
        llm.shutdown()


def test_speculative_outputs_equal_plain_outputs_over_200_random_requests(engines):
    plain, speculative = engines
    before = speculative.stats().spec_decode.num_accepted_tokens
    assert_same_outputs_over_random_requests(plain, speculative)
    stats = speculative.stats()
    assert stats.num_preemptions > 0
    assert stats.spec_decode.num_accepted_tokens > before  # drafts were verified and some held
    speculative.engine.core.kv_cache.check_invariants()


def test_greedy_tokens_and_logprobs_equal_on_repeating_text(engines):
    plain, speculative = engines
    prompts = repeating_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=2)
    before = speculative.stats().spec_decode
    before = (before.num_drafts, before.num_accepted_tokens)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = speculative.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    counts = speculative.stats().spec_decode
    drafts, accepted = counts.num_drafts - before[0], counts.num_accepted_tokens - before[1]
    assert drafts > 0 and accepted > 0, (drafts, accepted)  # a random model copies little, but some held
    assert sum(counts.accepted_per_position) == counts.num_accepted_tokens
    for want, have in zip(expected, got):
        for step_want, step_have in zip(want.outputs[0].logprobs, have.outputs[0].logprobs):
            assert step_want.keys() == step_have.keys()
            for token, value in step_want.items():
                assert abs(step_have[token] - value) < 1e-4


def test_more_verifies_in_a_step_than_a_prefill_pack_holds(checkpoints):
    """The native path runs every verify of a step in one call, beyond max_prefill_seqs."""
    options = tiny_engine_options(device="cpu", max_prefill_seqs=2)
    plain = LLM(model=checkpoints["llama"], **options)
    speculative = LLM(model=checkpoints["llama"], speculative_config=NGRAM, **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in plain.generate(repeating_prompts(8), params, use_tqdm=False)]
        got = speculative.generate(repeating_prompts(8), params, use_tqdm=False)
        assert [o.error for o in got] == [None] * 8
        assert [o.outputs[0].token_ids for o in got] == want
        assert speculative.stats().spec_decode.num_drafts > 0
    finally:
        plain.shutdown()
        speculative.shutdown()


@pytest.mark.parametrize("max_tokens", range(1, 30))
def test_max_tokens_anywhere_in_an_accepted_run(engines, max_tokens):
    plain, speculative = engines
    prompts = repeating_prompts(3)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = speculative.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in got)


def test_stop_strings_and_stop_tokens_inside_an_accepted_run(engines):
    plain, speculative = engines
    prompts = repeating_prompts(4)
    reference = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    for prompt, ref in zip(prompts, reference):
        tokens, text = ref.outputs[0].token_ids, ref.outputs[0].text
        for cut in (5, 13, 22, 31):
            stops = dict(stop=[text[len(text) * cut // 40:][:3]]) if text.strip() else {}
            for extra in (stops, dict(stop_token_ids=[tokens[cut]])):
                params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, **extra)
                want = plain.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                have = speculative.generate(prompt, params, use_tqdm=False)[0].outputs[0]
                assert (have.token_ids, have.text, have.finish_reason, have.stop_reason) == \
                    (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert speculative.stats().kv_blocks_used == 0


def test_start_up_report_names_the_speculative_config(engines):
    from tpu_executor.engine.stats import startup_report

    _, speculative = engines
    report = startup_report(speculative.engine.config, speculative.stats(), 1.0)
    assert "speculative decoding: ngram, 3 draft tokens, n-grams of 1-3" in report


def test_no_drafts_above_disable_by_batch_size(checkpoints):
    config = dict(NGRAM, disable_by_batch_size=2)
    llm = LLM(model=checkpoints["llama"], speculative_config=config, **tiny_engine_options(device="cpu"))
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        llm.generate(repeating_prompts(6), params, use_tqdm=False)  # 6 running: none speculates
        assert llm.stats().spec_decode.num_drafts == 0
        llm.generate(repeating_prompts(2), params, use_tqdm=False)
        assert llm.stats().spec_decode.num_drafts > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "model": "x"}, "method 'eagle' is not supported"),
    ({"method": "medusa"}, "not supported"),
    ({"method": "eagle3"}, "method 'eagle3' needs \"model\""),
    ({"method": "lookahead"}, "unknown speculative_config method 'lookahead'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer from 1 to 16"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size must be a positive integer"),
    ({"method": "ngram", "num_draft_tokens": 4}, "unknown speculative_config keys ['num_draft_tokens']"),
    ({"num_speculative_tokens": 4}, "needs a method"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_speculative_config_names_the_problem(value, message):
    with pytest.raises(ValueError) as err:
        SpeculativeConfig.parse(value)
    assert message in str(err.value)


def test_async_scheduling_with_speculation_is_refused(checkpoints):
    with pytest.raises(ValueError, match="async_scheduling cannot be on with speculative decoding"):
        LLM(model=checkpoints["llama"], speculative_config=NGRAM, async_scheduling=True,
            **tiny_engine_options(device="cpu"))


def test_the_command_line_takes_a_json_speculative_config():
    import argparse

    from tpu_executor.engine.options import add_engine_arguments, engine_options_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5}'])
    options = engine_options_from_args(args)
    assert SpeculativeConfig.parse(options["speculative_config"]) == SpeculativeConfig(num_speculative_tokens=5)


@pytest.mark.parametrize("tokens, drafts", [
    ([1, 2, 3, 9, 1, 2, 3], (9, 1, 2)),  # the 3-gram 1 2 3 recurs: what followed it
    ([5, 6, 7, 8, 6, 7], (8, 6, 7)),  # a 2-gram
    ([1, 2, 3, 4], ()),  # nothing recurs
    ([4, 4, 4, 4, 4], (4, 4)),  # no occurrence has a full draft after it: the earliest, the longest
    ([4, 4, 4, 4, 4, 4, 4], (4, 4, 4)),  # the latest occurrence a full draft follows
    ([7, 1, 2, 8, 8, 1, 2, 9, 9, 9, 1, 2], (9, 9, 9)),  # latest of several occurrences
    ([7, 1, 2, 8, 1, 2], (8, 1, 2)),  # only one earlier: its follower, to the end
])
def test_ngram_drafts(tokens, drafts):
    assert ngram_drafts(tokens, 3, 2, 3) == drafts


def test_ngram_drafts_prefer_the_longest_suffix():
    # The 1-gram 3 last followed by 5; the 3-gram 1 2 3 by 4: the longer match wins.
    assert ngram_drafts([3, 5, 1, 2, 3, 4, 0, 1, 2, 3], 1, 1, 3) == (4,)
    assert ngram_drafts([3, 5, 1, 2, 3, 4, 0, 1, 2, 3], 1, 1, 1) == (4,)  # the latest occurrence of 3
