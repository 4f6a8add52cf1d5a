"""A drafter that fails costs the step its drafts, never its tokens: the target's tokens of that
step stand, its requests decode without drafts, a WARNING says why, and the engine serves on,
drafting again (native path, draft model, EAGLE-3 head and n-gram drafter). Ranks must fail
alike: one rank's drafter failing alone stops the group, as a step failing on one rank does."""
import logging
import random
from dataclasses import replace

import pytest

from tests.common import greedy_tokens, tiny_engine_options
from tpu_executor import LLM
from tpu_executor.core.step import ModelRunnerOutput, SampledTokens
from tpu_executor.executor.base import WorkerFailure, agree_on_step
from tpu_executor.tools.eagle3_head import write_random_eagle3_head

MAX_TOKENS = 24


def random_prompts(count: int, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(count)]


def failing_on_call(real, call: int, calls: list):
    """``real`` that raises at its ``call``-th call; ``calls`` collects each call's arguments."""
    def fn(*args):
        calls.append(args)
        if len(calls) == call:
            raise RuntimeError("drafter fell over")
        return real(*args)
    return fn


@pytest.fixture(scope="module")
def plain(checkpoints):
    llm = LLM(model=checkpoints["llama"], **tiny_engine_options(device="cpu", block_size=16))
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_a_drafter_error_keeps_the_steps_tokens_and_the_engine_drafts_on(plain, checkpoints, tmp_path, method,
                                                                         monkeypatch, caplog):
    target = checkpoints["llama"]
    draft = target if method == "draft_model" else write_random_eagle3_head(target, str(tmp_path / "head"), 300)
    speculative = LLM(model=target, speculative_config={"method": method, "model": draft, "num_speculative_tokens": 3},
                      **tiny_engine_options(device="cpu", block_size=16))
    try:
        prompts = random_prompts(4)
        want = greedy_tokens(plain, prompts, MAX_TOKENS)
        drafter, calls = speculative.engine.core.executor.workers[0].drafter, []
        monkeypatch.setattr(drafter, "draft", failing_on_call(drafter.draft, 3, calls))
        with caplog.at_level(logging.WARNING, logger="tpu_executor.worker.worker"):
            assert greedy_tokens(speculative, prompts, MAX_TOKENS) == want
        step, _ = calls[2]
        assert step.drafting  # the failed call had requests to draft for
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"the {drafter.kind} failed: RuntimeError: drafter fell over" in w for w in warnings), warnings
        drafted = speculative.stats().spec_decode.num_drafts
        assert drafted > 0 and len(calls) > 3
        assert greedy_tokens(speculative, prompts, MAX_TOKENS) == want  # serving on, drafting again
        assert speculative.stats().spec_decode.num_drafts > drafted
    finally:
        speculative.shutdown()


def test_an_ngram_drafter_error_costs_the_request_its_drafts(plain, checkpoints, monkeypatch, caplog):
    from tpu_executor.engine import drafter

    speculative = LLM(model=checkpoints["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                      **tiny_engine_options(device="cpu", block_size=16))
    try:
        prompts = [p * 3 for p in random_prompts(3, seed=1)]  # text that repeats: prompt lookup drafts
        want = greedy_tokens(plain, prompts, MAX_TOKENS)
        calls = []
        monkeypatch.setattr(drafter, "ngram_drafts", failing_on_call(drafter.ngram_drafts, 2, calls))
        with caplog.at_level(logging.WARNING, logger="tpu_executor.engine.drafter"):
            assert greedy_tokens(speculative, prompts, MAX_TOKENS) == want
        assert any("it decodes without drafts" in r.getMessage() for r in caplog.records)
        assert len(calls) > 2 and speculative.stats().spec_decode.num_drafts > 0
    finally:
        speculative.shutdown()


def test_ranks_must_agree_on_a_drafter_failure():
    """Every rank's drafter failing alike (a deterministic error) leaves them in step: the
    tokens stand without drafts. One rank's failing alone (its cache and collectives are no
    longer the others') stops the group, as a step failing on one rank does."""
    ran = ModelRunnerOutput(sampled=SampledTokens(["a"], [5], [0.0]), drafts={"a": (7, 8)})
    failed = replace(ran, drafts={}, draft_error="the draft model failed: RuntimeError: drafter fell over")
    assert agree_on_step([failed, failed]) is failed
    assert agree_on_step([ran, ran]) is ran
    with pytest.raises(WorkerFailure, match="rank 0: ran it; rank 1: the draft model failed"):
        agree_on_step([ran, failed])
