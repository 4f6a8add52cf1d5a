"""A chat output's reasoning read apart from its answer (``--reasoning-parser``), as vLLM's
reasoning parsers return it: the text between ``<think>`` and ``</think>`` is the reasoning,
what follows is the content (which tool calls are then read from).

Where the reasoning starts:
- ``qwen3``: where the output opens ``<think>``, or at the output's start when the prompt left
  a ``<think>`` open (templates of thinking-only checkpoints end the generation prompt with it);
  an output that never opens one (``enable_thinking: false`` puts a closed, empty block in the
  prompt) is all content;
- ``deepseek_r1``: always at the output's start (its template opens ``<think>`` in the prompt).

Reasoning runs to ``</think>``; an output cut before it (``max_tokens``) is all reasoning, the
same whole and streamed. A stream holds back a tail that may still become a marker.

The engine, given the same ``reasoning_parser``, starts a request's grammar (structured
outputs, required or named tool calls) after the ``</think>`` token by the same rules, read on
token ids (``engine/structured_outputs.py``): the grammar's output is the content.
"""
from __future__ import annotations

from typing import Optional, Tuple

from tpu_executor.entrypoints.openai.tool_parsers import partial_marker_start

THINK_START, THINK_END = "<think>", "</think>"


def starts_in_reasoning(parser: str, prompt_text: Optional[str]) -> bool:
    """Whether the output begins inside the reasoning, before it writes anything."""
    if parser == "deepseek_r1":
        return True
    text = prompt_text or ""
    return text.rfind(THINK_START) > text.rfind(THINK_END)


def split_reasoning(text: str, in_reasoning: bool) -> Tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of a whole output; None where there is none."""
    stream = StreamedReasoning(in_reasoning)
    reasoning, content = stream.add(text)
    held_reasoning, held_content = stream.finish()
    return (reasoning + held_reasoning) or None, (content + held_content) or None


class StreamedReasoning:
    """One choice's output, fed as it comes: each ``add`` returns the new (reasoning, content)
    text, holding back a tail that may still become a marker until the next ``add`` or
    ``finish``."""

    def __init__(self, in_reasoning: bool):
        self.phase = "reasoning" if in_reasoning else "start"  # start -> reasoning -> content
        self.held = ""

    def add(self, new_text: str) -> Tuple[str, str]:
        text, self.held = self.held + new_text, ""
        reasoning = content = ""
        if self.phase == "start":
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                self.phase, text = "reasoning", stripped[len(THINK_START):]
            elif stripped and not THINK_START.startswith(stripped):
                self.phase = "content"
            else:  # blanks, or the start of "<think>": wait for more
                self.held = text
                return "", ""
        if self.phase == "reasoning":
            end = text.find(THINK_END)
            if end < 0:
                held_from = partial_marker_start(text, THINK_END)
                held_from = len(text) if held_from is None else held_from
                self.held = text[held_from:]
                return text[:held_from], ""
            reasoning, text, self.phase = text[:end], text[end + len(THINK_END):], "content"
        content = text
        return reasoning, content

    def finish(self) -> Tuple[str, str]:
        """What was held back, at the output's end: reasoning inside it, else content."""
        held, self.held = self.held, ""
        return (held, "") if self.phase == "reasoning" else ("", held)

