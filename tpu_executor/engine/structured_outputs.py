"""Structured outputs: grammars (xgrammar) that decide, at every step, which tokens a request may
sample next.

The front-end compiles a request's grammar when the request arrives (``GrammarCompiler``: once
per distinct grammar, then cached; one that cannot be compiled is a ValueError naming the
field, before anything is queued). The core keeps a matcher per constrained sample
(``GrammarMatchers``): before a step it fills each constrained row's token bitmask, which
travels with the step to the workers; after the step it advances the matcher by the token
recorded. The device applies the bitmask inside the compiled sampler
(``worker/logits_processing.py``), with the rest of the logits processing.

With a reasoning parser (the engine option ``reasoning_parser``) a grammar constrains only the
answer, as vLLM's does: a sample in its reasoning is neither masked nor advanced until it
samples the reasoning's end token (``</think>``), and the grammar constrains every token after
it. Where an output starts is the server's rule (``entrypoints/openai/reasoning.py``), read on
token ids: ``deepseek_r1`` in the reasoning; ``qwen3`` in it when the prompt's last marker is
``<think>``, in the answer when it is ``</think>`` (a template that turned thinking off), and
else free to open ``<think>`` with its first token (the only token allowed beside the grammar's).
"""
from __future__ import annotations

import collections
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from tpu_executor.core.sampling_params import StructuredOutputsParams

_CACHED_GRAMMARS = 512  # distinct grammars kept compiled (least recently used go first)
# Whitespace JSON may hold between two of its tokens (unless compact): enough for any indented
# layout, and a model that keeps choosing blanks cannot spend its max_tokens on them.
MAX_JSON_WHITESPACE = 16
# xgrammar writes the characters of a length-limited string as this class, which lets raw
# control characters through (JSON requires them escaped); ours excludes them.
_LENIENT_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'
_XGRAMMAR_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # "[17:25:56] /project/cpp/x.cc:83: "


def _message(err: Exception) -> str:
    """xgrammar's error text without its time stamp and C++ source location."""
    return _XGRAMMAR_LOCATION.sub("", str(err).strip().splitlines()[0] if str(err).strip() else repr(err))


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose language is exactly ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def json_grammar(schema: str, any_whitespace: bool) -> str:
    """EBNF for JSON following ``schema`` (xgrammar's, strings free of raw control characters;
    at most ``MAX_JSON_WHITESPACE`` blanks between tokens, none when not ``any_whitespace``)."""
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if any_whitespace else None)
    return str(grammar).replace(_LENIENT_STRING_CHARACTER, _JSON_STRING_CHARACTER)


def _refuse_constant(name: str):
    raise ValueError(f"structured_outputs.json holds {name}, which JSON does not allow")


def checked_schema(text: str) -> dict:
    """The JSON Schema in ``text``, or a ValueError saying why it is not one."""
    try:
        return _checked_schema(text)
    except RecursionError:
        raise ValueError("structured_outputs.json is nested too deeply to check") from None


def _checked_schema(text: str) -> dict:
    import jsonschema

    try:
        schema = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as err:
        raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "the top level"
        raise ValueError(f"structured_outputs.json is not a valid JSON Schema at {where}: {err.message}") from None

    return schema


THINK_START, THINK_END = "<think>", "</think>"
# Where a constrained sample is: its grammar constrains the answer; in the reasoning it is free;
# at an output's start that may open the reasoning, the grammar's tokens and <think> are allowed.
ANSWER, REASONING, OPENING = "answer", "reasoning", "opening"


@dataclass(frozen=True)
class ReasoningMarkers:
    """A reasoning parser's marker tokens in one tokenizer: where a grammar starts."""

    parser: str
    start_id: int  # <think>
    end_id: int  # </think>

    @classmethod
    def of(cls, parser: str, tokenizer) -> "ReasoningMarkers":
        """``parser``'s markers in a Hugging Face tokenizer; a ValueError when it lacks them (the
        engine could not tell where a grammar starts)."""
        vocab = tokenizer.get_vocab()
        missing = [marker for marker in (THINK_START, THINK_END) if marker not in vocab]
        if missing:
            raise ValueError(f"structured_outputs cannot follow reasoning_parser {parser!r}: this model's "
                             f"tokenizer has no {' or '.join(missing)} token (start the engine without "
                             "reasoning_parser to constrain the whole output)")
        return cls(parser, vocab[THINK_START], vocab[THINK_END])

    def first_phase(self, prompt_token_ids: Sequence[int]) -> str:
        """Where an output of this prompt starts: ANSWER, REASONING or OPENING."""
        if self.parser == "deepseek_r1":
            return REASONING
        for token_id in reversed(prompt_token_ids):
            if token_id == self.start_id:
                return REASONING
            if token_id == self.end_id:
                return ANSWER
        return OPENING


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` into xgrammar grammars over one tokenizer's
    vocabulary (padded to the model's). Thread-safe; compiled grammars are cached by spec.
    ``reasoning``: the engine's reasoning markers (None: grammars constrain whole outputs).
    Pickles as its tokenizer's description (an engine core in another process rebuilds it)."""

    def __init__(self, tokenizer_info, on_compiled: Optional[Callable[[float], None]] = None,
                 reasoning: Optional[ReasoningMarkers] = None):
        import xgrammar

        self.tokenizer_info = tokenizer_info
        self.on_compiled = on_compiled  # called with each compilation's seconds (metrics)
        self.reasoning = reasoning
        self.vocab_size: int = tokenizer_info.vocab_size
        self._compiler = xgrammar.GrammarCompiler(tokenizer_info, cache_enabled=False)
        self._cache: "collections.OrderedDict[StructuredOutputsParams, object]" = collections.OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, on_compiled: Optional[Callable[[float], None]] = None,
                      reasoning_parser: Optional[str] = None) -> "GrammarCompiler":
        """A compiler for a Hugging Face tokenizer and a model of ``vocab_size`` logits, whose
        grammars start after ``reasoning_parser``'s reasoning (when given)."""
        import xgrammar

        reasoning = None if reasoning_parser is None else ReasoningMarkers.of(reasoning_parser, tokenizer)
        return cls(xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size), on_compiled, reasoning)

    @classmethod
    def from_serialized(cls, text: str, reasoning: Optional[ReasoningMarkers] = None) -> "GrammarCompiler":
        import xgrammar

        return cls(xgrammar.TokenizerInfo.deserialize_json(text), reasoning=reasoning)

    def __reduce__(self):
        return GrammarCompiler.from_serialized, (self.tokenizer_info.serialize_json(), self.reasoning)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec`` (xgrammar's ``CompiledGrammar``); ValueError whose
        message starts with the field at fault when it cannot be compiled."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        start = time.perf_counter()
        compiled = self._compile(spec)
        if self.on_compiled is not None:
            self.on_compiled(time.perf_counter() - start)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams):
        kind, compiler = spec.kind, self._compiler
        any_whitespace = not spec.disable_any_whitespace
        try:
            if kind in ("json", "json_object"):
                schema = json.dumps(checked_schema(spec.json)) if kind == "json" else '{"type": "object"}'
                return compiler.compile_grammar(json_grammar(schema, any_whitespace))
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            return compiler.compile_grammar(choice_grammar(spec.choice) if kind == "choice" else spec.grammar)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - xgrammar raises RuntimeError and its own kinds
            raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_message(err)}") from None


class GrammarMatchers:
    """The core's side: a matcher per constrained sample, the bitmasks of a step, and the
    matchers advanced by the tokens a step recorded. A sample outside its answer (see the
    module's text) is in ``_phases`` until its answer starts."""

    def __init__(self, compiler: GrammarCompiler):
        import xgrammar

        self.compiler = compiler
        self._xgrammar = xgrammar
        self._matchers: Dict[str, object] = {}
        self._phases: Dict[str, str] = {}  # REASONING or OPENING, by sample id

    def __bool__(self) -> bool:
        return bool(self._matchers)

    def add(self, sample_id: str, spec: StructuredOutputsParams, prompt_token_ids: Sequence[int] = ()) -> None:
        self._matchers[sample_id] = self._xgrammar.GrammarMatcher(self.compiler.compile(spec))
        reasoning = self.compiler.reasoning
        phase = ANSWER if reasoning is None else reasoning.first_phase(prompt_token_ids)
        if phase != ANSWER:
            self._phases[sample_id] = phase

    def remove(self, sample_id: str) -> None:
        self._matchers.pop(sample_id, None)
        self._phases.pop(sample_id, None)

    def constrains_any(self, sample_ids: Sequence[str]) -> bool:
        """Whether a step of these samples needs the grammars (one in its reasoning does too:
        the token just sampled may end it)."""
        matchers = self._matchers
        return bool(matchers) and any(sample_id in matchers for sample_id in sample_ids)

    def bitmasks(self, sample_ids: Sequence[str]) -> Dict[str, np.ndarray]:
        """The allowed-token bitmask (int32 words) of each constrained sample among
        ``sample_ids``; a sample in its reasoning gets none (it is free), nor does one whose
        grammar finished (it is ending)."""
        rows = [(sample_id, self._matchers[sample_id]) for sample_id in sample_ids
                if sample_id in self._matchers and self._phases.get(sample_id) != REASONING
                and not self._matchers[sample_id].is_terminated()]
        if not rows:
            return {}
        masks = self._xgrammar.allocate_token_bitmask(len(rows), self.compiler.vocab_size)
        for row, (_, matcher) in enumerate(rows):
            matcher.fill_next_token_bitmask(masks, row)
        masks = masks.numpy()
        for row, (sample_id, _) in enumerate(rows):
            if self._phases.get(sample_id) == OPENING:  # the output may open its reasoning instead
                start = self.compiler.reasoning.start_id
                masks.view(np.uint32)[row, start // 32] |= np.uint32(1 << (start % 32))
        return {sample_id: masks[row] for row, (sample_id, _) in enumerate(rows)}

    def accept(self, sample_id: str, token_id: int) -> Optional[str]:
        """Advance the sample's matcher by ``token_id`` (or its reasoning, outside its answer);
        an error message if its grammar does not allow the token (None when it does, or the
        sample is not constrained)."""
        phase = self._phases.get(sample_id)
        if phase == REASONING:
            if token_id == self.compiler.reasoning.end_id:
                del self._phases[sample_id]  # the answer starts with the next token
            return None
        if phase == OPENING:
            if token_id == self.compiler.reasoning.start_id:
                self._phases[sample_id] = REASONING
                return None
            del self._phases[sample_id]  # the answer starts with this token
        matcher = self._matchers.get(sample_id)
        if matcher is None or matcher.is_terminated() or matcher.accept_token(token_id):
            return None
        # The mask lets only the grammar's tokens through, so a refused token means the request's
        # own bans (allowed_token_ids, bad_words, min_tokens) left the grammar none.
        return (f"structured_outputs: the request's allowed_token_ids, bad_words or min_tokens leave no token "
                f"its grammar allows (token {token_id} was drawn)")
