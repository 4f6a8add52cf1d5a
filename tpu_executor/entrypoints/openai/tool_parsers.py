"""The model's text read back as tool calls, in the format its family was trained on.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after any text
  (Qwen2.5, Qwen3, Hermes fine-tunes; the format for families without one of their own);
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` objects separated
  by ``;``, maybe after ``<|python_tag|>`` (Llama 3.1 to 3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``
  (the marker is a special token, so the text may hold only the list).

``parse`` splits a whole output into (content, calls); ``held_from`` tells a stream where the
text it must hold back starts (a call, or what may still become one), so content before it
streams as it comes and the calls go out once the output is complete. Text that does not
parse as calls stays content, whole.
"""
from __future__ import annotations

import json
import re
from typing import List, NamedTuple, Optional, Tuple

from tpu_executor.entrypoints.openai.config import TOOL_CALL_FORMATS as FORMATS  # noqa: F401 - the names

# The format of each model family (``model_type`` in its config.json); others use hermes.
FAMILY_FORMATS = {"llama": "llama3_json", "mistral": "mistral", "mixtral": "mistral"}
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_DECODER = json.JSONDecoder()


class ParsedCall(NamedTuple):
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


def format_for_family(model_type: Optional[str]) -> str:
    return FAMILY_FORMATS.get(model_type or "", "hermes")


def call_of(obj, arguments_keys=("arguments", "parameters")) -> Optional[ParsedCall]:
    """A call from a decoded JSON object, None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = next((obj[key] for key in arguments_keys if key in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str, separators: str = "") -> Optional[list]:
    """Every JSON value in ``text``, one after another (blanks and ``separators`` between);
    None if anything else is there."""
    values, position = [], 0
    while True:
        while position < len(text) and (text[position].isspace() or text[position] in separators):
            position += 1
        if position == len(text):
            return values
        try:
            value, position = _DECODER.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)


def parse(text: str, fmt: str) -> Tuple[Optional[str], List[ParsedCall]]:
    """(content, calls) of a whole output; content is None when the output is only calls."""
    start = held_from(text, fmt)
    if start is None:
        return text, []
    calls = _calls(text[start:], fmt)
    if not calls:
        return text, []
    return (text[:start] or None), calls


def _calls(held: str, fmt: str) -> List[ParsedCall]:
    if fmt == "hermes":
        blocks = [json_values(block) for block in _HERMES_BLOCK.findall(held)]
        objects = [b[0] for b in blocks if b is not None and len(b) == 1]
        if len(objects) != len(blocks):
            return []
    else:
        held = held.strip()
        for marker in ("<|python_tag|>", "[TOOL_CALLS]"):
            held = held[len(marker):] if held.startswith(marker) else held
        values = json_values(held, ";" if fmt == "llama3_json" else "")
        if values is None:
            return []
        objects = values[0] if fmt == "mistral" and len(values) == 1 and isinstance(values[0], list) else values
    calls = [call_of(obj) for obj in objects]
    return calls if calls and all(calls) else []


def held_from(text: str, fmt: str) -> Optional[int]:
    """Where in ``text`` (an output so far) calls start or may start; None while it is plain
    content: at a marker (``<tool_call>``, ``[TOOL_CALLS]``) or a tail that may become one, or
    at the start of an output whose first character opens a call (``{`` for Llama 3, ``[`` for
    Mistral)."""
    if fmt == "llama3_json":
        return _opening(text, ("{", "<|python_tag|>"))
    marker = "<tool_call>" if fmt == "hermes" else "[TOOL_CALLS]"
    start = text.find(marker)
    if start >= 0:
        return start
    opened = _opening(text, ("[",)) if fmt == "mistral" else None
    return opened if opened is not None else partial_marker_start(text, marker)


def _opening(text: str, openings: Tuple[str, ...]) -> Optional[int]:
    """0-based start of the output's first non-blank character if it opens a call (or the
    output is still blank)."""
    stripped = text.lstrip()
    if not stripped or any(stripped.startswith(o) or o.startswith(stripped) for o in openings):
        return len(text) - len(stripped)
    return None


def partial_marker_start(text: str, marker: str) -> Optional[int]:
    """Where a tail of ``text`` that begins ``marker`` starts (None: no such tail)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return len(text) - size
    return None
