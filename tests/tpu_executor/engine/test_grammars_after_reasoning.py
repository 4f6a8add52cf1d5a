"""A grammar under a reasoning parser constrains the answer only: the core's matchers
(``GrammarMatchers``) driven token by token, with the tiny Llama's tokenizer given ``<think>``
and ``</think>`` as tokens. No mask while reasoning, whatever tokens it holds; the grammar's own
mask from the token after ``</think>`` on; where each parser starts an output, by the prompt."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from tpu_executor.core.sampling_params import StructuredOutputsParams
from tpu_executor.engine.structured_outputs import GrammarCompiler, GrammarMatchers

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}
SPEC = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["llama"])
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


@pytest.fixture(scope="module")
def ids(tokenizer):
    texts = ("<think>", "</think>", "ka", "{", "\n")
    encoded = {text: tokenizer.encode(text, add_special_tokens=False) for text in texts}
    assert all(len(tokens) == 1 for tokens in encoded.values()), encoded
    return {text: tokens[0] for text, tokens in encoded.items()}


def matchers(tokenizer, parser=None) -> GrammarMatchers:
    return GrammarMatchers(GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer), reasoning_parser=parser))


def allowed(masks, sample_id="s"):
    """The token ids a sample's bitmask allows; None when the step gives it no mask."""
    if sample_id not in masks:
        return None
    return set(np.flatnonzero(np.unpackbits(masks[sample_id].view(np.uint8), bitorder="little")).tolist())


def grammar_alone(tokenizer, *tokens):
    """What the grammar allows, unconstrained by any reasoning, after ``tokens``."""
    plain = matchers(tokenizer)
    plain.add("s", SPEC)
    for token in tokens:
        assert plain.accept("s", token) is None
    return allowed(plain.bitmasks(["s"]))


def test_deepseek_r1_reasons_unmasked_then_its_answer_follows_the_grammar(tokenizer, ids):
    grammars = matchers(tokenizer, "deepseek_r1")
    grammars.add("s", SPEC, tokenizer.encode("what is it"))
    assert grammars.constrains_any(["s"])  # the step waits: the token in flight may end the reasoning
    for token in (ids["ka"], ids["<think>"], ids["\n"], ids["ka"]):  # tokens no JSON starts with
        assert allowed(grammars.bitmasks(["s"])) is None
        assert grammars.accept("s", token) is None
    assert grammars.accept("s", ids["</think>"]) is None
    first = allowed(grammars.bitmasks(["s"]))
    assert first == grammar_alone(tokenizer) and ids["{"] in first and ids["</think>"] not in first
    assert grammars.accept("s", ids["{"]) is None
    assert allowed(grammars.bitmasks(["s"])) == grammar_alone(tokenizer, ids["{"])
    assert "leave no token its grammar allows" in grammars.accept("s", ids["ka"])


@pytest.mark.parametrize("prompt_end, masked_from_the_start", [("<think>\n", False), ("<think>\n\n</think>\n\n", True),
                                                               ("<think>a</think>b<think>", False)])
def test_qwen3_starts_where_the_prompt_left_the_reasoning(tokenizer, ids, prompt_end, masked_from_the_start):
    grammars = matchers(tokenizer, "qwen3")
    grammars.add("s", SPEC, tokenizer.encode("<|im_start|>assistant\n" + prompt_end))
    expected = grammar_alone(tokenizer) if masked_from_the_start else None
    assert allowed(grammars.bitmasks(["s"])) == expected


def test_qwen3_may_open_its_reasoning_with_the_first_token_only(tokenizer, ids):
    prompt = tokenizer.encode("<|im_start|>assistant\n")  # no marker: the output may open <think>
    opens, answers = matchers(tokenizer, "qwen3"), matchers(tokenizer, "qwen3")
    for grammars in (opens, answers):
        grammars.add("s", SPEC, prompt)
        assert allowed(grammars.bitmasks(["s"])) == grammar_alone(tokenizer) | {ids["<think>"]}
    assert opens.accept("s", ids["<think>"]) is None
    assert allowed(opens.bitmasks(["s"])) is None and opens.accept("s", ids["ka"]) is None
    assert opens.accept("s", ids["</think>"]) is None
    assert allowed(opens.bitmasks(["s"])) == grammar_alone(tokenizer)
    assert answers.accept("s", ids["{"]) is None  # the answer started: no <think> any more
    assert allowed(answers.bitmasks(["s"])) == grammar_alone(tokenizer, ids["{"])


def test_the_reasoning_markers_travel_to_a_core_in_another_process(tokenizer, ids):
    compiler = pickle.loads(pickle.dumps(GrammarCompiler.for_tokenizer(tokenizer, len(tokenizer),
                                                                       reasoning_parser="qwen3")))
    assert (compiler.reasoning.parser, compiler.reasoning.start_id, compiler.reasoning.end_id) == (
        "qwen3", ids["<think>"], ids["</think>"])


def test_a_tokenizer_without_the_markers_is_refused_naming_the_field(checkpoints):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(checkpoints["llama"])
    with pytest.raises(ValueError, match=r"^structured_outputs cannot follow reasoning_parser 'deepseek_r1': .* "
                                         r"no <think> or </think> token"):
        GrammarCompiler.for_tokenizer(plain, len(plain), reasoning_parser="deepseek_r1")
