"""Incremental detokenization and stop conditions (pure Python; the tokenizer is passed in).

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

from tpu_executor.core.request import Request, RequestStatus

# How many earlier tokens give the context that decides a token's text.
_CONTEXT_TOKENS = 6


@dataclass(slots=True)
class DetokenizerState:
    """Per-sample decoding state: the text not handed out yet, the decode window offsets, and
    the sample's stop conditions."""

    unsent: List[str] = field(default_factory=list)  # text pieces not in a delta yet, in order
    prefix_offset: int = 0
    read_offset: int = 0
    # A tokenizers DecodeStream: always, for a fast tokenizer without a piece table; with one,
    # only while the text is not whole.
    stream: Any = None
    # The sample's stop conditions, settled once (``advance`` runs every step): the outputs
    # it may make (max_tokens, or fewer where the context ends first), the ids that stop it
    # (EOS unless ignored, and stop_token_ids), the EOS id if it stops, its stop strings.
    max_outputs: int = 0
    stop_token_ids: frozenset = frozenset()
    eos_token_id: Optional[int] = None
    stops: Tuple[str, ...] = ()
    # Characters just before a token's text that can begin a stop string it completes
    # (len(longest stop) - 1): kept in ``tail``, and held back from deltas while the sample
    # runs, unless include_stop_str_in_output (the cut then never reaches sent text).
    stop_overlap: int = 0
    include_stop: bool = False
    tail: str = ""


class Detokenizer:
    """Turns output tokens into text and decides when a request is finished."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._backend = _stream_backend(tokenizer)
        self._pieces = _whole_character_pieces(self._backend)  # empty: no piece table

    def new_state(self, request: Request) -> DetokenizerState:
        """A sample's decoding state, after its prompt."""
        prompt_token_ids, params = request.prompt_token_ids, request.sampling_params
        eos = None if params.ignore_eos else request.eos_token_id
        state = DetokenizerState(
            prefix_offset=max(0, len(prompt_token_ids) - _CONTEXT_TOKENS), read_offset=len(prompt_token_ids),
            max_outputs=min(params.max_tokens, self.max_model_len - len(prompt_token_ids)),
            stop_token_ids=frozenset(params.stop_token_ids) | ({eos} if eos is not None else set()),
            eos_token_id=eos, stops=params.stop, stop_overlap=max(map(len, params.stop), default=1) - 1,
            include_stop=params.include_stop_str_in_output)
        if self._backend is not None and not self._pieces:
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

    def advance(self, request: Request, state: DetokenizerState) -> Optional[RequestStatus]:
        """Add the text of the request's newest output token, then check its stop conditions:
        the request's finish status, or None to go on. A stop string found in the text
        truncates it there (and sets ``request.stop_reason``). Runs for every running sequence
        on every step, so the common checks read plain attributes in one call."""
        outputs = request.output_token_ids
        last = outputs[-1]
        if state.stream is None and (new_text := self._pieces.get(last)) is not None:
            state.unsent.append(new_text)  # the text so far is whole: the token adds its own text
        elif self._backend is not None:
            new_text = self._stream_text(state, last)
        else:
            new_text = self._window_text(request, state)
        if last in state.stop_token_ids:
            if last != state.eos_token_id:
                request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if new_text and state.stops and _truncate_at_stop(request, state, new_text):
            return RequestStatus.FINISHED_STOPPED
        if len(outputs) >= state.max_outputs:
            return RequestStatus.FINISHED_LENGTH
        return None

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

    def _window_text(self, request: Request, state: DetokenizerState) -> str:
        """The new characters of the newest token, by decoding a short window (no stream)."""
        all_token_ids = request.all_token_ids
        prefix = self._decode(all_token_ids[state.prefix_offset:state.read_offset])
        full = self._decode(all_token_ids[state.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character or a token with no text yet
        new_text = full[len(prefix):]
        state.unsent.append(new_text)
        state.prefix_offset, state.read_offset = state.read_offset, len(all_token_ids)
        return new_text


def _truncate_at_stop(request: Request, state: DetokenizerState, new_text: str) -> bool:
    """Whether ``new_text`` completes one of the sample's stop strings; if so, the unsent text
    is cut where it began (or ended, with include_stop_str_in_output). Only the new text and
    the characters just before it can hold a stop string that was not there before; what the
    cut drops is all unsent (the hold-back keeps it so)."""
    window = state.tail + new_text
    for stop in state.stops:
        at = window.find(stop)
        if at != -1:
            dropped = len(window) - (at + len(stop) if state.include_stop else at)
            if dropped:
                unsent = "".join(state.unsent)
                state.unsent = [unsent[:len(unsent) - dropped]]
            request.stop_reason = stop
            return True
    keep = state.stop_overlap
    state.tail = window[-keep:] if keep else ""
    return False


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
