"""Penalties, logit bias, min_tokens, allowed token ids and bad words end to end: greedy tokens
equal to transformers' own repetition penalty, and to a decoder that runs transformers' model
through the one-row reference of ``worker/logits_processing.py`` (log-probs, the model's own,
within tolerance), on the native path and on XLA, with nothing compiled after warm-up."""
from __future__ import annotations

import pytest
import torch

from tests.common import assert_nothing_compiled_after_warmup, hf_greedy, mixed_prompts, tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.core.request import logits_processing
from tpu_executor.worker.logits_processing import process_logits_reference

NEW_TOKENS = 24
DEVICES = [pytest.param("xla", marks=pytest.mark.slow), "cpu"]


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, checkpoints):
    engine = LLM(checkpoints["llama"], device=request.param, **tiny_engine_options(strict=True))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_model(checkpoints):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoints["llama"], dtype=torch.float32).eval()


def prompts():
    return mixed_prompts(4, 8, 60, vocab=500, seed=21)


def test_repetition_penalty_matches_transformers(llm, checkpoints, hf_model):
    expected = []
    for prompt in prompts():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    assert expected != hf_greedy(checkpoints["llama"], prompts(), NEW_TOKENS)[0]  # the penalty changes tokens
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


CASES = {
    "presence and frequency": dict(presence_penalty=1.5, frequency_penalty=0.8),
    "logit bias": dict(logit_bias={17: 9.0, 33: -100.0, 250: 4.0}),
    "min_tokens before a favoured EOS": dict(logit_bias={2: 60.0}, min_tokens=6, ignore_eos=False),
    "allowed token ids": dict(allowed_token_ids=[40, 41, 42, 43, 44, 45, 46, 47]),
    "bad words": dict(bad_words=["ruka", "isshizune", "=="]),  # words these prompts produce
    "everything at once": dict(presence_penalty=-0.5, repetition_penalty=0.7, logit_bias={9: 3.0}, min_tokens=3,
                               bad_words=["po ve"], ignore_eos=False),
}


def reference_decode(hf_model, prompt, params: SamplingParams, processing, stop_ids):
    """Greedy decoding with transformers' model and the reference processing: (tokens, the
    model's log-probs at each step)."""
    outputs, logprobs = [], []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + outputs])).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, dim=-1))
        token = int(torch.argmax(process_logits_reference(logits, processing, prompt, outputs)))
        outputs.append(token)
        if token in stop_ids:
            break
    return outputs, logprobs


@pytest.mark.parametrize("case", sorted(CASES))
def test_processed_greedy_tokens_and_logprobs_equal_the_reference(llm, hf_model, case):
    params = SamplingParams(**{**dict(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5),
                               **CASES[case]})
    eos = llm.get_tokenizer().eos_token_id
    stop_ids = frozenset() if params.ignore_eos else frozenset({eos})
    processing = logits_processing(params, stop_ids, llm.engine.checks.bad_words_token_ids(params))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    for prompt, out in zip(prompts(), outs):
        expected, expected_lp = reference_decode(hf_model, prompt, params, processing, stop_ids)
        completion = out.outputs[0]
        assert completion.token_ids == expected, case
        for step, top in enumerate(completion.logprobs):
            ids = torch.tensor(list(top))
            torch.testing.assert_close(torch.tensor(list(top.values())), expected_lp[step][ids], atol=1e-3, rtol=0)
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts()],
                         SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=params.ignore_eos),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in outs]  # it did something
    if case.startswith("min_tokens"):
        assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].finish_reason == "stop" for o in outs)
    assert_nothing_compiled_after_warmup(llm)
