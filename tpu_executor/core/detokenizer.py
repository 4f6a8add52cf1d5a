"""Incremental detokenization and stop strings (pure Python; the tokenizer is passed in). Stop
tokens and lengths need no text: the scheduler checks them (``Scheduler.update``).

Text is decoded incrementally. A fast tokenizer (one backed by the ``tokenizers`` library)
decodes through a ``DecodeStream`` per sample, primed with the prompt's last tokens: one call
per token, which holds back incomplete UTF-8 sequences itself. Any other tokenizer (or one that
cleans up spaces after decoding, which a stream cannot know) goes through a prefix window: a
token's text can depend on its neighbours (byte-level BPE, SentencePiece's leading spaces), so
each step decodes a short window and keeps only the new characters. The window costs two full
``decode`` calls per token, the stream about a tenth of that.

Byte-level BPE (GPT-2's decoder: Llama 3, Qwen, SmolLM2) needs even less. Its decoder maps each
token to bytes on its own and decodes their concatenation, so once the text so far ends on a
whole character, a token whose bytes are whole characters adds exactly its own text, whatever
came before. Those texts are looked up in a table made once per engine (one batched decode of
the vocabulary); a token that is only part of a character goes through a ``DecodeStream``,
made when needed, until the text is whole again. That is a list index per token instead of a
call into the tokenizer. Such a decoder adds no space before a first token, so its samples'
text starts from their own first token, unprimed by the prompt: a prompt given as ids that
ends inside a character does not lend its bytes to the output.

Streaming: the text handed out so far must never be taken back, yet a stop string that
completes later truncates the text where it began. So while a request with stop strings runs,
the last ``len(longest stop) - 1`` characters are held back (as vLLM does); they go out with
the next delta or, truncated, with the last one.

The text is kept as the pieces not handed out yet, never as one growing string: appending to
a string copies it, which made every token cost time in proportion to the text so far. A
piece from the table is the table's own string; a delta joins the pieces since the last one.
A stop string is looked for in the new text and the characters just before it, kept apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tpu_executor.core.sampling_params import SamplingParams

# How many earlier tokens give the context that decides a token's text.
_CONTEXT_TOKENS = 6


@dataclass(slots=True)
class DetokenizerState:
    """Per-sample decoding state: the text not handed out yet, the decode window, and the
    sample's stop strings."""

    unsent: List[str] = field(default_factory=list)  # text pieces not in a delta yet, in order
    # The window path's tokens (the prompt's last few, then the outputs) and its offsets.
    token_ids: List[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    # A tokenizers DecodeStream: always, for a fast tokenizer without a piece table; with one,
    # only while the text is not whole.
    stream: Any = None
    stops: Tuple[str, ...] = ()
    # Characters just before a token's text that can begin a stop string it completes
    # (len(longest stop) - 1): kept in ``tail``, and held back from deltas while the sample
    # runs, unless include_stop_str_in_output (the cut then never reaches sent text).
    stop_overlap: int = 0
    include_stop: bool = False
    tail: str = ""


class Detokenizer:
    """Turns output tokens into text, one token at a time."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._backend = _stream_backend(tokenizer)
        self._pieces = _whole_character_pieces(self._backend)  # empty: no piece table

    def new_state(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> DetokenizerState:
        """A sample's decoding state, after its prompt."""
        state = DetokenizerState(stops=params.stop, stop_overlap=max(map(len, params.stop), default=1) - 1,
                                 include_stop=params.include_stop_str_in_output)
        if self._backend is None:
            state.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
            state.read_offset = len(state.token_ids)
        elif not self._pieces:
            from tokenizers.decoders import DecodeStream

            # Primed with the prompt's tail, so the first output token keeps its leading space.
            state.stream = DecodeStream(ids=self._priming_context(prompt_token_ids), skip_special_tokens=True)
        return state

    def _priming_context(self, prompt_token_ids: Sequence[int]) -> List[int]:
        """The prompt's last tokens, less those that leave it inside a character: a
        DecodeStream primed with text ending in U+FFFD hands that prompt text out with its
        first delta. So a prompt given as ids that ends inside a character does not lend its
        bytes to the output, as with the piece table."""
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        while context and self._backend.decode(context, skip_special_tokens=True).endswith("\ufffd"):
            context.pop()
        return context

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def add_token(self, state: DetokenizerState, token_id: int) -> str:
        """Add the text of the sample's next output token to its unsent text; returns that text
        (empty while a character is incomplete). Runs for every running sequence on every step:
        the common case is one dictionary look-up."""
        if state.stream is None and (new_text := self._pieces.get(token_id)) is not None:
            state.unsent.append(new_text)  # the text so far is whole: the token adds its own text
            return new_text
        if self._backend is not None:
            return self._stream_text(state, token_id)
        return self._window_text(state, token_id)

    def _stream_text(self, state: DetokenizerState, token_id: int) -> str:
        """The new text of ``token_id`` through the sample's ``DecodeStream``. With a piece
        table the stream is made here, empty (the text so far is whole, so nothing before
        changes what comes next), and dropped once it gives text: it holds nothing back then."""
        if state.stream is None:
            from tokenizers.decoders import DecodeStream

            state.stream = DecodeStream(skip_special_tokens=True)
        new_text = state.stream.step(self._backend, token_id)
        if new_text:
            state.unsent.append(new_text)
            if self._pieces:
                state.stream = None
        return new_text or ""

    def _window_text(self, state: DetokenizerState, token_id: int) -> str:
        """The new characters of ``token_id``, by decoding a short window (no stream)."""
        token_ids = state.token_ids
        token_ids.append(token_id)
        prefix = self._decode(token_ids[state.prefix_offset:state.read_offset])
        full = self._decode(token_ids[state.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character or a token with no text yet
        new_text = full[len(prefix):]
        state.unsent.append(new_text)
        state.prefix_offset, state.read_offset = state.read_offset, len(token_ids)
        return new_text


def truncate_at_stop(state: DetokenizerState, new_text: str, search: bool = True) -> Optional[str]:
    """The stop string ``new_text`` completes, if any; the unsent text is then cut where it
    began (or ended, with include_stop_str_in_output). Only the new text and the characters
    just before it can hold a stop string that was not there before; what the cut drops is all
    unsent (the hold-back keeps it so). ``search`` off (a sample short of ``min_tokens``)
    only keeps the characters a later stop string may begin with."""
    window = state.tail + new_text
    for stop in state.stops if search else ():
        at = window.find(stop)
        if at != -1:
            dropped = len(window) - (at + len(stop) if state.include_stop else at)
            if dropped:
                unsent = "".join(state.unsent)
                state.unsent = [unsent[:len(unsent) - dropped]]
            return stop
    keep = state.stop_overlap
    state.tail = window[-keep:] if keep else ""
    return None


def _stream_backend(tokenizer) -> Optional[Any]:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` if a DecodeStream gives the same text
    as its ``decode``; else None (the window path)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401 - tokenizers >= 0.21
    except ImportError:
        return None
    return backend


def _whole_character_pieces(backend) -> Dict[int, str]:
    """For a byte-level BPE decoder: the text of each token whose bytes are whole characters
    (not those whose text holds a U+FFFD: a piece of a character, or one a stream would hold
    back), by id; empty for any other decoder."""
    if backend is None:
        return {}
    from tokenizers import decoders

    if type(backend.decoder) is not decoders.ByteLevel:
        return {}
    size = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=True)
    return {token_id: text for token_id, text in enumerate(texts) if "\ufffd" not in text}


def take_text_delta(state: DetokenizerState, finished: bool) -> str:
    """The text not handed out yet, less the hold-back a later stop string could still cut
    (none once the sample has finished)."""
    text = "".join(state.unsent)  # one piece: that string itself, not a copy
    hold_back = 0 if finished or state.include_stop else state.stop_overlap
    if hold_back:
        state.unsent = [text[-hold_back:]] if text else []
        return text[:-hold_back]
    state.unsent.clear()
    return text
