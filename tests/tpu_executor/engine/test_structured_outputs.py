"""Structured outputs on a tiny random Llama: every output of 22 JSON schemas (nested objects,
arrays, enums, numbers, patterns, lengths, ``required``, ``$ref``) parses and validates, regex
and choice outputs match; greedy tokens equal a reference decoder (transformers' fp32 logits
masked by xgrammar's matcher, argmax) on the native and XLA paths; bad grammars are refused
with the field named and the engine goes on; constrained rows batched with others give what
they give alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.common import tiny_engine_options
from tpu_executor import LLM, SamplingParams
from tpu_executor.core.sampling_params import StructuredOutputsParams

NAME = {"type": "string", "maxLength": 8}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
ITEM = {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["sku", "qty"], "additionalProperties": False}


def closed(properties: dict, required=None) -> dict:
    """An object schema with exactly ``properties`` (all required unless said)."""
    return {"type": "object", "properties": properties, "additionalProperties": False,
            "required": list(properties) if required is None else required}


SCHEMAS = [
    {"type": "integer", "minimum": -5, "maximum": 500},
    {"type": "number", "minimum": 0, "maximum": 10},
    {"type": "boolean"},
    {"enum": ["alpha", "beta", 3, None]},
    {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"},
    {"type": "string", "minLength": 2, "maxLength": 5},
    {"type": "string", "enum": ["2024-01-01", "2025-12-31"]},
    {"type": "array", "items": DIGIT, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 2, "maxItems": 2},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": ["on", "off"]}],
     "items": False},
    {"anyOf": [DIGIT, {"type": "string", "maxLength": 3}]},
    closed({"id": {"type": "integer", "minimum": 1, "maximum": 1000}, "name": NAME}),
    closed({"user": closed({"age": {"type": "integer", "minimum": 0, "maximum": 120}, "nick": NAME}, ["age"])}),
    closed({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}}),
    closed({"kind": {"const": "point"}, "x": {"type": "number", "minimum": -1, "maximum": 1},
            "y": {"type": "number", "minimum": -1, "maximum": 1}}),
    closed({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599},
            "detail": {"type": ["string", "null"], "maxLength": 6}}),
    {"$defs": {"item": ITEM}, **closed({"items": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                  "minItems": 1, "maxItems": 2}})},
    closed({"a": DIGIT, "b": DIGIT}, ["a"]),
    closed({"matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                             "maximum": 1},
                                                  "minItems": 2, "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    closed({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}, "verified": {"type": "boolean"}}),
    closed({"score": {"type": "number", "minimum": 0, "maximum": 100}, "grade": {"enum": ["A", "B", "C"]}}),
    closed({"point": closed({"x": DIGIT, "y": DIGIT}), "label": {"type": ["string", "null"], "maxLength": 4}}),
]
REGEX = r"[a-c]{2,4}-\d{3}( [xyz]+)?"
CHOICES = ["red", "green", "dark blue", 'say "hi"']


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(model=checkpoints["llama"], device="cpu", **tiny_engine_options())


def compact(schema) -> StructuredOutputsParams:
    # A random model picks blanks wherever they may go; compact JSON keeps outputs short.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def constrained(spec: StructuredOutputsParams, temperature: float = 0.0, seed: int = 0, max_tokens: int = 200):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=spec)


def assert_follows(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice


def test_every_output_of_22_json_schemas_validates(llm):
    specs = [compact(schema) for schema in SCHEMAS]
    params = [constrained(spec, temperature, seed) for seed, spec in enumerate(specs) for temperature in (0.0, 1.0)]
    outputs = llm.generate(["{"] * len(params), params, use_tqdm=False)
    for p, output in zip(params, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (p.structured_outputs.json, completion.text)
        assert_follows(p.structured_outputs, completion.text)
    assert len({o.outputs[0].text for o in outputs}) > len(SCHEMAS)  # the model's choices, not one fixed text


def test_json_with_free_whitespace_and_json_object_parse(llm):
    specs = [StructuredOutputsParams(json=SCHEMAS[11]), StructuredOutputsParams(json=SCHEMAS[17]),
             StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    params = [constrained(spec, 1.0, seed, max_tokens=300) for seed, spec in enumerate(specs)]
    outputs = llm.generate(["hello"] * len(params), params, use_tqdm=False)
    for p, output in zip(params[:2], outputs[:2]):
        assert output.outputs[0].finish_reason == "stop"
        assert_follows(p.structured_outputs, output.outputs[0].text)
    # Any JSON object: unbounded, so a random model may run out of tokens; what it wrote is JSON so far.
    text, finish = outputs[2].outputs[0].text, outputs[2].outputs[0].finish_reason
    assert text.startswith("{") and (finish == "length" or isinstance(json.loads(text), dict))


def test_regex_and_choice_outputs_match(llm):
    specs = [StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]
    params = [constrained(spec, temperature, seed) for spec in specs for seed, temperature in enumerate((0, 1, 1, 1))]
    outputs = llm.generate(["pick one:"] * len(params), params, use_tqdm=False)
    for p, output in zip(params, outputs):
        assert output.outputs[0].finish_reason == "stop"
        assert_follows(p.structured_outputs, output.outputs[0].text)


def reference_tokens(path: str, compiler, prompt_ids, spec, max_tokens: int):
    """Greedy tokens of transformers' fp32 model with every step's logits masked by xgrammar's
    matcher (the grammar's own API, not the engine's)."""
    import xgrammar
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    matcher = xgrammar.GrammarMatcher(compiler.compile(spec))
    bitmask = xgrammar.allocate_token_bitmask(1, compiler.vocab_size)
    tokens = []
    while len(tokens) < max_tokens and not matcher.is_terminated():
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0, -1].float()[None]
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        tokens.append(int(logits.argmax()))
        assert matcher.accept_token(tokens[-1])
    return tokens


REFERENCE_SPECS = [compact(SCHEMAS[11]), compact(SCHEMAS[16]), StructuredOutputsParams(json=SCHEMAS[13]),
                   StructuredOutputsParams(regex=REGEX), StructuredOutputsParams(choice=CHOICES)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("xla", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_the_reference_decoder(checkpoints, llm, device):
    engine = llm if device == "cpu" else LLM(model=checkpoints["llama"], device="xla",
                                             **tiny_engine_options(strict=True))
    prompt = {"prompt_token_ids": [5, 17, 230, 44, 9]}
    params = [constrained(spec, max_tokens=120) for spec in REFERENCE_SPECS]
    outputs = engine.generate([prompt] * len(params), params, use_tqdm=False)
    compiler = llm.engine.checks.grammar_compiler
    for p, output in zip(params, outputs):
        expected = reference_tokens(checkpoints["llama"], compiler, prompt["prompt_token_ids"], p.structured_outputs,
                                    120)
        assert output.outputs[0].token_ids == expected  # the EOS that ends the grammar included
        assert expected[-1] == llm.engine.tokenizer.eos_token_id or len(expected) == 120
    if device == "xla":
        assert engine.stats().graphs_compiled_after_warmup == 0
        engine.shutdown()


BAD_GRAMMARS = [
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json={"type": "frobnicate"}), "structured_outputs.json is not a valid JSON Schema"),
    (dict(json={"type": "string", "minLength": "three"}), "structured_outputs.json is not a valid JSON Schema"),
    (dict(json=[1, 2]), "must be a JSON Schema object"),
    (dict(regex="([a-z]"), "structured_outputs.regex cannot be compiled"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar cannot be compiled"),
    (dict(grammar="root ::= "), "structured_outputs.grammar cannot be compiled"),
]


@pytest.mark.parametrize("fields, message", BAD_GRAMMARS)
def test_a_grammar_that_cannot_compile_is_refused_and_the_engine_goes_on(llm, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(["x"], constrained(StructuredOutputsParams(**fields)), use_tqdm=False)
    output = llm.generate(["x"], constrained(StructuredOutputsParams(choice=["ok"])), use_tqdm=False)
    assert output[0].outputs[0].text == "ok"


@pytest.mark.parametrize("fields", [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice=["a", ""]),
                                    dict(json_object=False), dict(grammar="  ")])
def test_a_spec_with_no_grammar_or_two_is_refused(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


def test_constrained_rows_batched_with_others_give_what_they_give_alone(llm):
    """Grammars, penalties and plain rows in one batch (asynchronous scheduling: a constrained
    step waits for the step in flight) give each row's tokens as it gets them alone."""
    specs = [compact(SCHEMAS[11]), StructuredOutputsParams(regex=REGEX), None, compact(SCHEMAS[18]), None]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec,
                             presence_penalty=0.5 if i == 2 else 0.0) for i, spec in enumerate(specs)]
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(len(params))]
    alone = [llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids for prompt, p in zip(prompts, params)]
    batched = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    assert llm.stats().kv_blocks_used == 0


def test_the_patch_of_xgrammars_string_characters_still_finds_its_text():
    """``json_grammar`` swaps the character class xgrammar writes for a length-limited string
    (raw control characters allowed) for JSON's; if an xgrammar release writes it otherwise the
    swap would silently do nothing, so the text it looks for must be in xgrammar's grammar."""
    import xgrammar

    from tpu_executor.engine import structured_outputs as so

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
                         "required": ["name"]})
    assert so._LENIENT_STRING_CHARACTER in str(xgrammar.Grammar.from_json_schema(schema))
    patched = so.json_grammar(schema, any_whitespace=False)
    assert so._LENIENT_STRING_CHARACTER not in patched and so._JSON_STRING_CHARACTER in patched
    xgrammar.Grammar.from_ebnf(patched)  # still a grammar xgrammar reads
