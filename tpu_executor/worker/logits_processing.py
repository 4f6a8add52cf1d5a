"""Logits processing on the device: penalties, logit bias, ``min_tokens``, allowed token ids, bad
words and grammars (``SamplingParams``), inside the compiled sampler, in fixed shapes.

What a step needs of a request's past (which tokens it has output, how often, which the prompt
holds, its last few outputs) lives on the device, in one slot per running request whose logits
are processed: ``counts [S+1, V]`` (each token's count among the outputs), ``prompt_seen
[S+1, V]`` (1 where the prompt holds the token), ``recent [S+1, L]`` (the last L outputs, -1
where there are fewer). The sampler records every token it samples there itself, so the state
is current even while the host has not read the token back (asynchronous scheduling). A
request's slot is filled from its tokens so far (``PrefillWork.history``) when its prompt's
last chunk is sampled, and freed when the request is absent from a step (finished, or
preempted: it is prefilled again, and filled again, when it comes back). Slot S is a discard
slot for rows without processing. A grammar's bitmask is the one input made anew every step:
the host's matcher fills it (``engine/structured_outputs.py``) and the step carries it.

``process_logits_reference`` is THE spec, one row at a time; the device functions below are
held to it.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from tpu_executor.core.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_ENTRIES
from tpu_executor.core.step import ENTRY_ALLOWED, ENTRY_BANNED, ENTRY_BIAS, ENTRY_STOP, LogitsProcessing
from tpu_executor.worker.transfer import tensor_to_device

RECENT = MAX_BAD_WORD_TOKENS - 1  # outputs a bad word's prefix is matched against
ANY_TOKEN = -2  # a prefix position before the word's first token (matches anything)
Fill = Tuple[int, tuple, int]  # (slot, the request's tokens so far, its prompt length)
NO_BITMASKS: Mapping[str, np.ndarray] = MappingProxyType({})


# ---- the spec ---------------------------------------------------------------------------------
def process_logits_reference(logits: torch.Tensor, processing: LogitsProcessing, prompt: Sequence[int],
                             outputs: Sequence[int], token_bitmask: Optional[Sequence[int]] = None) -> torch.Tensor:
    """One row's logits ``[V]`` after ``processing``, given its prompt and outputs so far (vLLM's
    order: penalties, then the bias, then the masks; a grammar's ``token_bitmask`` bans every
    token whose bit is clear)."""
    logits = logits.clone().float()
    counts = {t: list(outputs).count(t) for t in set(outputs)}
    for token in set(prompt) | set(outputs):
        value = logits[token]
        penalty = processing.repetition_penalty
        logits[token] = value / penalty if value > 0 else value * penalty
    for token, count in counts.items():
        logits[token] -= processing.frequency_penalty * count + processing.presence_penalty
    entries = list(zip(processing.entry_ids, processing.entry_values, processing.entry_kinds))
    for token, value, kind in entries:
        if kind == ENTRY_BIAS:
            logits[token] += value
    allowed = {token for token, _, kind in entries if kind == ENTRY_ALLOWED}
    banned = {token for token, _, kind in entries
              if kind == ENTRY_BANNED or (kind == ENTRY_STOP and len(outputs) < processing.min_tokens)}
    for prefix, last in zip(processing.bad_word_prefixes, processing.bad_word_last):
        if len(outputs) >= len(prefix) and tuple(outputs[len(outputs) - len(prefix):]) == tuple(prefix):
            banned.add(last)
    if allowed:
        banned |= set(range(logits.shape[0])) - allowed
    if token_bitmask is not None:
        banned |= {t for t in range(logits.shape[0]) if not (int(token_bitmask[t // 32]) >> (t % 32)) & 1}
    for token in banned:
        logits[token] = float("-inf")
    return logits


# ---- on the device ----------------------------------------------------------------------------
class ProcessingRows(NamedTuple):
    """A sampler call's per-row processing inputs, one pytree for torch.compile and jax.jit:
    each row's slot, penalties (presence, frequency, repetition), entries ``[B, K]`` (-1:
    none), ``min_tokens``, bad-word prefixes ``[B, W, L]`` (right-aligned, ``ANY_TOKEN`` before
    a word), last tokens ``[B, W]`` (-1: none) and the grammar's bitmask ``[B, ceil(V / 32)]``
    int32 (all bits set: no grammar)."""

    state_slots: torch.Tensor
    penalties: torch.Tensor
    entry_ids: torch.Tensor
    entry_values: torch.Tensor
    entry_kinds: torch.Tensor
    min_tokens: torch.Tensor
    bad_prefixes: torch.Tensor
    bad_last: torch.Tensor
    token_bitmask: torch.Tensor


def process_logits(logits: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor, recent: torch.Tensor,
                   rows: ProcessingRows, steps: torch.Tensor) -> torch.Tensor:
    """``process_logits_reference`` for every row of ``logits [B, V]`` at once, given the
    state, the rows' inputs and their outputs so far (``steps``)."""
    row_counts = counts.index_select(0, rows.state_slots)
    seen = (prompt_seen.index_select(0, rows.state_slots) > 0) | (row_counts > 0)
    penalties, ids, kinds = rows.penalties, rows.entry_ids.clamp(min=0), rows.entry_kinds
    repetition = penalties[:, 2:3]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - penalties[:, 1:2] * row_counts - penalties[:, 0:1] * (row_counts > 0).to(logits.dtype)
    valid = rows.entry_ids >= 0
    bias = torch.where(valid & (kinds == ENTRY_BIAS), rows.entry_values, torch.zeros_like(rows.entry_values))
    logits = logits + torch.zeros_like(logits).scatter_add(1, ids, bias)
    allowed = valid & (kinds == ENTRY_ALLOWED)
    stopping = (kinds == ENTRY_STOP) & (steps < rows.min_tokens)[:, None]
    banned = _marked(logits, ids, valid & ((kinds == ENTRY_BANNED) | stopping))
    banned = banned | (allowed.any(dim=1, keepdim=True) & ~_marked(logits, ids, allowed))
    last = recent.index_select(0, rows.state_slots)[:, None, :]
    completes = ((rows.bad_prefixes == last) | (rows.bad_prefixes == ANY_TOKEN)).all(dim=-1) & (rows.bad_last >= 0)
    banned = banned | _marked(logits, rows.bad_last.clamp(min=0), completes)
    return logits.masked_fill(banned | ~grammar_allows(rows.token_bitmask, logits.shape[1]), float("-inf"))


def grammar_allows(token_bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` booleans from int32 bitmask words ``[B, ceil(V / 32)]``: token ``t`` is bit
    ``t % 32`` of word ``t // 32``."""
    tokens = torch.arange(vocab_size, device=token_bitmask.device)
    words = token_bitmask.index_select(1, tokens // 32)
    return torch.bitwise_and(torch.bitwise_right_shift(words, (tokens % 32).to(words.dtype)), 1) > 0


def _marked(like: torch.Tensor, ids: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` booleans: True at ``ids [B, K]`` where ``selected``."""
    return torch.zeros_like(like).scatter_add(1, ids, selected.to(like.dtype)) > 0


def record_tokens(counts: torch.Tensor, recent: torch.Tensor, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Count each row's sampled token in its slot and append it to the slot's recent outputs
    (in place; rows without processing write the discard slot)."""
    counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)
    previous = recent.index_select(0, slots)
    recent.index_copy_(0, slots, torch.cat([previous[:, 1:], token_ids[:, None]], dim=1))


def fill_slots(counts: torch.Tensor, prompt_seen: torch.Tensor, recent: torch.Tensor, slots: torch.Tensor,
               history: torch.Tensor, prompt_lens: torch.Tensor, recent_outputs: torch.Tensor) -> None:
    """Set the slots of requests whose last prompt chunk is sampled now from their tokens so
    far: ``history [n, H]`` (prompt then outputs, -1 after), ``prompt_lens [n]``,
    ``recent_outputs [n, L]`` (in place)."""
    counts.index_copy_(0, slots, torch.zeros(slots.shape[0], counts.shape[1], dtype=counts.dtype, device=counts.device))
    prompt_seen.index_copy_(0, slots, torch.zeros_like(counts.index_select(0, slots)))
    positions = torch.arange(history.shape[1], device=history.device)[None, :]
    valid, is_output = history >= 0, positions >= prompt_lens[:, None]
    rows, ids = slots[:, None].expand_as(history), history.clamp(min=0)
    counts.index_put_((rows, ids), (valid & is_output).to(counts.dtype), accumulate=True)
    prompt_seen.index_put_((rows, ids), (valid & ~is_output).to(counts.dtype), accumulate=True)
    recent.index_copy_(0, slots, recent_outputs)


def donate(*buffers: torch.Tensor) -> None:
    """Mark state updated in place inside a compiled graph as donated (XLA would copy it)."""
    if buffers[0].device.type == "xla":
        for buffer in buffers:
            torch.ops.xla.dynamo_set_buffer_donor_(buffer, True)


# ---- the host's side --------------------------------------------------------------------------
class ProcessingSlots:
    """The device state and which request holds which slot.

    ``begin_step`` frees the slots of requests absent from the step; ``prepare`` gives a call's
    rows their slots and per-row tensors (new requests get a slot and a fill)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.discard = num_slots
        self.bitmask_words = (vocab_size + 31) // 32
        self._bitmasks: Mapping[str, np.ndarray] = {}
        self.counts = tensor_to_device(torch.zeros(num_slots + 1, vocab_size), device)
        self.prompt_seen = tensor_to_device(torch.zeros(num_slots + 1, vocab_size), device)
        self.recent = tensor_to_device(torch.full((num_slots + 1, RECENT), -1, dtype=torch.int64), device)
        self._slots: Dict[str, int] = {}
        self._rows: Dict[str, Dict[str, np.ndarray]] = {}
        self._free: List[int] = list(range(num_slots))

    @property
    def state(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(counts, prompt_seen, recent), as the compiled functions take them."""
        return self.counts, self.prompt_seen, self.recent

    def begin_step(self, present: Sequence[str], token_bitmasks: Mapping[str, np.ndarray] = NO_BITMASKS) -> None:
        """Free the slots of the requests that are not in this step; take the step's grammar
        bitmasks."""
        self._bitmasks = token_bitmasks
        keep = set(present)
        for request_id in [r for r in self._slots if r not in keep]:
            self._free.append(self._slots.pop(request_id))
            self._rows.pop(request_id, None)

    def prepare(self, work: Sequence, rows: int) -> Optional[Tuple[ProcessingRows, List[Fill]]]:
        """None when no row of ``work`` is processed; else (its per-row host tensors padded to
        ``rows``, the fills to run first: (slot, history, prompt length) of each row whose
        history arrives now)."""
        processed = [(row, item) for row, item in enumerate(work) if item.sampling.processing is not None
                     and (getattr(item, "history", None) is not None or item.request_id in self._slots)]
        if not processed:
            return None  # no processing, or only prompt chunks that sample nothing
        arrays, fills = empty_rows(rows, self.discard, self.bitmask_words), []
        for row, item in processed:
            history = getattr(item, "history", None)
            if history is not None:
                fills.append((self._take_slot(item.request_id, item.sampling.processing), history,
                              item.sampling.prompt_len))
            arrays["state_slots"][row] = self._slots[item.request_id]
            for name, value in self._rows[item.request_id].items():
                arrays[name][row] = value
            bitmask = self._bitmasks.get(item.request_id)
            if bitmask is not None:
                arrays["token_bitmask"][row] = bitmask
        return ProcessingRows(**{name: torch.from_numpy(a) for name, a in arrays.items()}), fills

    def _take_slot(self, request_id: str, processing: LogitsProcessing) -> int:
        if request_id not in self._slots:
            if not self._free:
                raise RuntimeError("no logits-processing slot free: more processed requests than max_num_seqs")
            self._slots[request_id] = self._free.pop()
        self._rows[request_id] = row_arrays(processing)
        return self._slots[request_id]


def empty_rows(rows: int, discard: int, bitmask_words: int) -> Dict[str, np.ndarray]:
    """Per-row inputs of rows without processing."""
    return {"state_slots": np.full(rows, discard, dtype=np.int64),
            "token_bitmask": np.full((rows, bitmask_words), -1, dtype=np.int32),
            "penalties": np.tile(np.array([0.0, 0.0, 1.0], dtype=np.float32), (rows, 1)),
            "entry_ids": np.full((rows, MAX_LOGIT_ENTRIES), -1, dtype=np.int64),
            "entry_values": np.zeros((rows, MAX_LOGIT_ENTRIES), dtype=np.float32),
            "entry_kinds": np.zeros((rows, MAX_LOGIT_ENTRIES), dtype=np.int64),
            "min_tokens": np.zeros(rows, dtype=np.int64),
            "bad_prefixes": np.full((rows, MAX_BAD_WORDS, RECENT), ANY_TOKEN, dtype=np.int64),
            "bad_last": np.full((rows, MAX_BAD_WORDS), -1, dtype=np.int64)}


def row_arrays(processing: LogitsProcessing) -> Dict[str, np.ndarray]:
    """One request's row of every per-row input (made once, copied into each call)."""
    row = {name: a[0] for name, a in empty_rows(1, 0, 0).items() if name not in ("state_slots", "token_bitmask")}
    row["penalties"][:] = (processing.presence_penalty, processing.frequency_penalty, processing.repetition_penalty)
    count = len(processing.entry_ids)
    row["entry_ids"][:count] = processing.entry_ids
    row["entry_values"][:count] = processing.entry_values
    row["entry_kinds"][:count] = processing.entry_kinds
    row["min_tokens"] = np.int64(processing.min_tokens)
    for word, (prefix, last) in enumerate(zip(processing.bad_word_prefixes, processing.bad_word_last)):
        row["bad_prefixes"][word, RECENT - len(prefix):] = prefix
        row["bad_last"][word] = last
    return row


def fill_tensors(fills: Sequence[Fill], rows: int, width: int, discard: int) -> Dict[str, torch.Tensor]:
    """``fill_slots``' inputs for ``fills`` padded to ``rows`` rows of ``width`` tokens."""
    slots = np.full(rows, discard, dtype=np.int64)
    history = np.full((rows, width), -1, dtype=np.int64)
    prompt_lens = np.zeros(rows, dtype=np.int64)
    recent = np.full((rows, RECENT), -1, dtype=np.int64)
    for row, (slot, tokens, prompt_len) in enumerate(fills):
        slots[row], prompt_lens[row] = slot, prompt_len
        history[row, :len(tokens)] = tokens
        outputs = tokens[prompt_len:][-RECENT:]
        if outputs:
            recent[row, RECENT - len(outputs):] = outputs
    return {name: torch.from_numpy(a) for name, a in
            dict(slots=slots, history=history, prompt_lens=prompt_lens, recent_outputs=recent).items()}


def empty_processing_rows(rows: int, slots: ProcessingSlots) -> ProcessingRows:
    """Per-row processing inputs of ``rows`` rows without processing (warm-up)."""
    arrays = empty_rows(rows, slots.discard, slots.bitmask_words)
    return ProcessingRows(**{name: torch.from_numpy(a) for name, a in arrays.items()})


def processed_request_ids(step) -> List[str]:
    """The requests of ``step`` whose logits are processed and sampled in it."""
    return [w.request_id for w in step.prefills if w.history is not None] + \
        [w.request_id for w in step.decodes if w.sampling.processing is not None]
