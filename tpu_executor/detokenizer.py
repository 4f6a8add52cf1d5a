"""Incremental detokenization and stop conditions (pure Python; the tokenizer is passed in).

Text is decoded incrementally with a prefix window: a token's text can depend on its
neighbours (byte-level BPE, SentencePiece's leading spaces), so each step decodes a short
window and keeps only the new characters, holding back incomplete UTF-8 sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from tpu_executor.request import Request, RequestStatus

# How many earlier tokens give the context that decides a token's text.
_CONTEXT_TOKENS = 6


@dataclass
class DetokenizerState:
    """Per-sample decoding state: the text so far and the decode window offsets."""

    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_text_len: Optional[int] = None


class Detokenizer:
    """Turns output tokens into text and decides when a request is finished."""

    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def new_state(self, prompt_token_ids: Sequence[int]) -> DetokenizerState:
        start = max(0, len(prompt_token_ids) - _CONTEXT_TOKENS)
        return DetokenizerState(prefix_offset=start, read_offset=len(prompt_token_ids))

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def append_token(self, state: DetokenizerState, all_token_ids: List[int]) -> str:
        """Add the text of the last token of ``all_token_ids``; returns the new characters."""
        prefix = self._decode(all_token_ids[state.prefix_offset:state.read_offset])
        full = self._decode(all_token_ids[state.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character or a token with no text yet
        new_text = full[len(prefix):]
        state.text += new_text
        state.prefix_offset, state.read_offset = state.read_offset, len(all_token_ids)
        return new_text

    def check_stop(self, request: Request, state: DetokenizerState, new_text: str) -> Optional[RequestStatus]:
        """The finish status of ``request`` after its latest token, or None to go on."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and request.eos_token_id is not None and last == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if new_text and params.stop and self._truncate_at_stop(request, state, new_text):
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _truncate_at_stop(request: Request, state: DetokenizerState, new_text: str) -> bool:
        params = request.sampling_params
        # Only the tail can hold a stop string that was not there before this token.
        longest = max(len(s) for s in params.stop)
        search_from = max(0, len(state.text) - len(new_text) - longest + 1)
        for stop in params.stop:
            at = state.text.find(stop, search_from)
            if at != -1:
                end = at + len(stop) if params.include_stop_str_in_output else at
                state.text = state.text[:end]
                request.stop_reason = stop
                return True
        return False
