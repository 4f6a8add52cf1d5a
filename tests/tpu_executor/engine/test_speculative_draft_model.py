"""Speculative decoding with a draft model (native path) changes nothing a user sees: the same
tokens, text, log-probs and finish reasons as decoding one token at a time, through chunked
prefill, preemption, prefix caching, stop tokens and ``max_tokens`` inside an accepted run, n > 1
and every sampling feature. A draft model equal to the target proposes the target's own greedy
tokens, so every draft holds; a bad draft checkpoint fails at start-up naming the problem."""
import random

import pytest

from tests.common import assert_same_outputs_over_random_requests, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.tools.random_checkpoint import TINY, build


def draft_config(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


def random_prompts(count: int, seed: int = 0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randrange(5, 90))]} for _ in range(count)]


@pytest.fixture(scope="module")
def engines(checkpoints):
    """(plain, draft model equal to the target, another architecture's draft) native engines
    with a small KV cache (requests get preempted) and a token budget of 64 (chunked prompts)."""
    options = tiny_engine_options(device="cpu", num_blocks=60, block_size=16, max_num_batched_tokens=64)
    target = checkpoints["llama"]
    trio = [LLM(model=target, **options),
            LLM(model=target, speculative_config=draft_config(target), **options),
            LLM(model=target, speculative_config=draft_config(checkpoints["mistral"], k=4), **options)]
    yield trio
    for llm in trio:
        llm.shutdown()


def test_outputs_equal_plain_outputs_over_200_random_requests(engines):
    plain, itself, other = engines
    for speculative in (itself, other):
        before = speculative.stats().spec_decode.num_drafts
        assert_same_outputs_over_random_requests(plain, speculative)
        stats = speculative.stats()
        assert stats.num_preemptions > 0
        assert stats.spec_decode.num_drafts > before
        speculative.engine.core.kv_cache.check_invariants()


def test_a_draft_model_equal_to_the_target_has_every_greedy_draft_accepted(checkpoints):
    target = checkpoints["llama"]
    options = tiny_engine_options(device="cpu", block_size=16)
    plain = LLM(model=target, **options)
    speculative = LLM(model=target, speculative_config=draft_config(target, k=4), **options)
    try:
        params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
        want = plain.generate(random_prompts(8), params, use_tqdm=False)
        assert all(len(set(o.outputs[0].token_ids)) > 10 for o in want)  # the model does not repeat itself
        got = speculative.generate(random_prompts(8), params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        counts = speculative.stats().spec_decode
        # Each request verifies 4 drafts per step after its first token: 40 tokens in 8 steps.
        assert counts.num_drafts == 8 * 8
        assert counts.num_accepted_tokens == counts.num_draft_tokens == 8 * 8 * 4
        assert counts.accepted_per_position == [64, 64, 64, 64]
    finally:
        plain.shutdown()
        speculative.shutdown()


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 12])
def test_max_tokens_and_stop_tokens_inside_an_accepted_run(engines, max_tokens):
    plain, itself, _ = engines
    prompts = random_prompts(3, seed=max_tokens)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in itself.generate(prompts, params, use_tqdm=False)] == want
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    reference = plain.generate(prompts[0], long, use_tqdm=False)[0].outputs[0].token_ids
    stop = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[reference[max_tokens + 4]])
    want, have = (llm.generate(prompts[0], stop, use_tqdm=False)[0].outputs[0] for llm in (plain, itself))
    assert (have.token_ids, have.finish_reason, have.stop_reason) == (want.token_ids, want.finish_reason,
                                                                     want.stop_reason)


def test_start_up_report_names_the_draft_model(engines, checkpoints):
    from tpu_executor.engine.stats import startup_report

    _, itself, _ = engines
    report = startup_report(itself.engine.config, itself.stats(), 1.0)
    assert f"speculative decoding: draft_model, 3 draft tokens, draft model {checkpoints['llama']}" in report


@pytest.fixture(scope="module")
def mismatched_drafts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {"vocabulary": build(str(root / "vocab"), "llama", dict(TINY, vocab_size=600)),
            "tokenizer": build(str(root / "tokenizer"), "llama", seed=1)}


@pytest.mark.parametrize("problem, message", [
    ("vocabulary", "has a vocabulary of 600 tokens, the target 512"),
    ("tokenizer", "has another tokenizer than the target"),
    ("missing", "is not a checkpoint directory"),
])
def test_a_draft_that_does_not_share_the_targets_tokens_is_refused(checkpoints, mismatched_drafts, problem,
                                                                   message, tmp_path):
    draft = str(tmp_path) if problem == "missing" else mismatched_drafts[problem]
    with pytest.raises(ValueError, match=message):
        LLM(model=checkpoints["llama"], speculative_config=draft_config(draft), **tiny_engine_options(device="cpu"))


@pytest.mark.parametrize("config, device, message", [
    ({"method": "draft_model"}, "cpu", "needs \"model\""),
    ({"method": "ngram", "model": "x"}, "cpu", "\"model\" is for methods \\('draft_model', 'eagle3'\\), not 'ngram'"),
])
def test_bad_draft_model_configs_name_the_problem(checkpoints, config, device, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=checkpoints["llama"], speculative_config=config, **tiny_engine_options(device=device))


def test_a_layer_draft_keeps_the_first_layers_and_the_tokenizer(checkpoints, tmp_path):
    from safetensors import safe_open

    from tpu_executor.tools.layer_draft import write_layer_draft
    from tpu_executor.worker.draft_model import check_draft_checkpoint
    from tpu_executor.worker.model_loader import load_hf_config

    target = checkpoints["llama"]
    draft = write_layer_draft(target, str(tmp_path / "draft"), 1)
    assert load_hf_config(draft).num_hidden_layers == 1
    with safe_open(f"{draft}/model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert any(".layers.0." in n for n in names) and not any(".layers.1." in n for n in names)
    check_draft_checkpoint(target, draft)  # the same vocabulary and tokenizer
    with pytest.raises(ValueError, match="num_layers must be from 1 to 1"):
        write_layer_draft(target, str(tmp_path / "bad"), 2)
