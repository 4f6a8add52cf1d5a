"""Speculative decoding with temperature > 0: each verified position draws with the sampler's
own seeded noise, so a draft is accepted exactly when it is the token the target draws there
(rejection sampling for a one-token draft). Checked three ways on a tiny Llama, native path:
seeded sampled requests give the tokens of the engine without speculation; they repeat exactly;
and over 20,000 draws of a three-token continuation (the last two decided by verifies), with a
drafter that is wrong most of the time, the continuations follow the model's own top-k
distribution (chi-square)."""
import math
import random

import pytest

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams

PROMPT = [17, 90, 33, 17, 90, 33, 17, 90]
TOP_K = 4


class GuessingDrafter:
    """Drafts random tokens among a few candidates: mostly wrong, sometimes right."""

    drafts_in_worker = False

    def __init__(self, candidates, seed=0):
        self.candidates, self.rng = list(candidates), random.Random(seed)

    def active(self, num_running):
        return True

    def propose(self, request, max_drafts):
        return tuple(self.rng.choice(self.candidates) for _ in range(min(max_drafts, 2)))


@pytest.fixture(scope="module")
def engines(checkpoints):
    options = tiny_engine_options(device="cpu", max_num_seqs=64)
    plain = LLM(model=checkpoints["llama"], **options)
    speculative = LLM(model=checkpoints["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                      **options)
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value exceeded with probability 0.1% (z = 3.09) at ``dof`` degrees of
    freedom, by the Wilson-Hilferty approximation (63 -> 103.5; the exact value is 103.4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def top_k_probabilities(llm, prefix):
    """The model's top-k distribution after ``prefix`` at temperature 1, from the engine's own
    log-probs (the plain engine's first token: the same logits the sampler sees)."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=TOP_K)
    top = llm.generate({"prompt_token_ids": prefix}, params, use_tqdm=False)[0].outputs[0].logprobs[0]
    weights = {token: math.exp(logprob) for token, logprob in sorted(top.items(), key=lambda kv: -kv[1])[:TOP_K]}
    return {token: weight / sum(weights.values()) for token, weight in weights.items()}


def test_seeded_sampling_gives_the_plain_engines_tokens_and_repeats(engines):
    plain, speculative = engines
    prompts = [{"prompt_token_ids": PROMPT * 2}, {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}]
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=24, ignore_eos=True, logprobs=1)
              for t, p, s in ((0.8, 1.0, 1), (1.3, 0.9, 2))]
    before = speculative.stats().spec_decode.num_drafts
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in speculative.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert speculative.stats().spec_decode.num_drafts > before


@pytest.mark.slow  # 20,000 requests
def test_drafted_over_tokens_follow_the_models_distribution(engines):
    plain, speculative = engines
    expected = {(): 1.0}  # the model's probability of each continuation of up to 3 tokens
    for _ in range(3):
        expected = {cell + (token,): p * q for cell, p in expected.items()
                    for token, q in top_k_probabilities(plain, PROMPT + list(cell)).items()}
    candidates = sorted({token for cell in expected for token in cell})
    scheduler = speculative.engine.core.scheduler
    scheduler.drafter, drafter = GuessingDrafter(candidates), scheduler.drafter
    try:
        draws = 20_000
        params = [SamplingParams(temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=3, ignore_eos=True)
                  for seed in range(draws)]
        before = scheduler.spec.num_draft_tokens, scheduler.spec.num_accepted_tokens
        outputs = speculative.generate([{"prompt_token_ids": PROMPT}] * draws, params, use_tqdm=False)
        drafted = scheduler.spec.num_draft_tokens - before[0]
        accepted = scheduler.spec.num_accepted_tokens - before[1]
    finally:
        scheduler.drafter = drafter
    assert drafted >= draws and 0.05 < accepted / drafted < 0.6  # drafts were verified, most rejected
    # Token 1 comes from the prompt's step; tokens 2 and 3 from verifies (the verifier decided them).
    counts = {}
    for output in outputs:
        cell = tuple(output.outputs[0].token_ids)
        counts[cell] = counts.get(cell, 0) + 1
    assert set(counts) <= set(expected) and len(expected) == TOP_K ** 3
    # Cells expected fewer than 5 times are pooled into one, as the chi-square test needs.
    rare = [cell for cell, p in expected.items() if p * draws < 5]
    observed = [counts.get(cell, 0) for cell in expected if cell not in rare] + [sum(counts.get(c, 0) for c in rare)]
    wanted = [p * draws for cell, p in expected.items() if cell not in rare] + [sum(expected[c] for c in rare) * draws]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    assert math.isfinite(statistic) and statistic < chi_square_critical(len(observed) - 1), (statistic, counts)
