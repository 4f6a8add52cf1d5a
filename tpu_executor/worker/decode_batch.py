"""The decode batch kept between steps (a persistent batch).

From one decode step to the next almost nothing changes: the same requests decode in the same
order, each one position further, and a block table grows only when a sequence crosses into a
new page (one step in ``block_size``). Rebuilding every row's block table and sampling
parameters from the step's work costs about a microsecond and a half per sequence and step;
here they stay in preallocated arrays and only the rows whose request, blocks or sampling
changed are written again. A row's block table and ``SamplingMeta`` are compared with what
its row was written from: by identity first, which settles most rows in-process (a request's
block table is the same tuple while its blocks do not change, ``KVCacheManager.block_table``,
and its ``SamplingMeta`` is built once), then by value.

Token ids and positions change every step and are read from the work directly. Each step's
tensors are copies of the kept arrays: a step still running (or an XLA transfer still reading
its host buffer) never sees the next step's writes.
"""
from __future__ import annotations

import operator
from types import MappingProxyType
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np
import torch

from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PENDING_TOKEN, DecodeWork, SamplingMeta
from tpu_executor.worker.inputs import SAMPLING_COLUMNS, table_slots
from tpu_executor.worker.token_feed import NO_FEED

_GREEDY = SamplingMeta.greedy()
# The sampler's columns, then the two the batch needs for steps and the log-prob flag.
_COLUMNS = SAMPLING_COLUMNS + (("prompt_len", "prompt_len", np.int64), ("num_logprobs", "num_logprobs", np.int64))


class PersistentDecodeBatch:
    """Block tables and sampling parameters of the decode rows, kept from step to step.

    ``update(work)`` makes the rows those of ``work`` (in its order); then ``inputs`` and
    ``sampling`` give the step's tensors padded to a bucket. ``max_rows`` and ``max_blocks``
    are the largest decode bucket's rows and block-table width.
    """

    def __init__(self, max_rows: int, max_blocks: int, lora: bool = False):
        self.max_rows = max_rows
        self.lora = lora  # the inputs carry each row's adapter slot (multi-LoRA)
        # One row more than a bucket holds: the last is never written and stays padding (null
        # blocks, greedy), so moving rows is one gather, with new rows taken from it.
        self._tables = np.full((max_rows + 1, max_blocks), NULL_BLOCK, dtype=np.int64)
        self._columns = {name: np.full(max_rows + 1, getattr(_GREEDY, field), dtype=dtype)
                         for name, field, dtype in _COLUMNS}
        self._ids: Tuple[str, ...] = ()
        # Per row: the block tuple its table row and the SamplingMeta its columns were written
        # from (None: padding).
        self._block_ids: List[object] = [None] * (max_rows + 1)
        self._metas: List[object] = [None] * (max_rows + 1)
        self._token_ids: Tuple[int, ...] = ()
        self._positions = np.zeros(0, dtype=np.int64)
        self._lora_slots: Tuple[int, ...] = ()

    def update(self, work: Sequence[DecodeWork]) -> None:
        """Make the rows those of ``work``: rows of requests that stay are moved (when the set
        or order changed), then every row whose blocks or sampling changed is written."""
        if len(work) > self.max_rows:
            raise ValueError(f"{len(work)} decode rows exceed the largest decode bucket ({self.max_rows})")
        # The work's columns, transposed in C (the items are tuples).
        ids, token_ids, positions, all_blocks, all_metas, lora_slots = zip(*work) if work else ((),) * 6
        if ids != self._ids:
            self._move_rows(ids)
        tables, block_ids, metas = self._tables, self._block_ids, self._metas
        for row, (blocks, meta) in enumerate(zip(all_blocks, all_metas)):
            # Identity first: in-process the objects are the scheduler's own and most rows stop
            # there; over Ray they arrive unpickled, and equality decides.
            if blocks is not block_ids[row]:
                if blocks != block_ids[row]:
                    tables[row, :len(blocks)] = blocks
                    tables[row, len(blocks):] = NULL_BLOCK
                block_ids[row] = blocks
            if meta is not metas[row]:
                if meta != metas[row]:
                    self._write_sampling(row, meta)
                metas[row] = meta
        self._token_ids, self._lora_slots = token_ids, lora_slots
        self._positions = np.array(positions, dtype=np.int64)

    def _move_rows(self, ids: Tuple[str, ...]) -> None:
        """Rows in the order of ``ids``: a staying request's row is copied from where it was;
        a new one, and every row past the end, is a copy of the padding row (``update``
        writes the new ones)."""
        padding = self.max_rows
        row_of = {request_id: row for row, request_id in enumerate(self._ids)}
        sources = [row_of.get(request_id, padding) for request_id in ids]
        sources += [padding] * (padding + 1 - len(sources))
        gather = operator.itemgetter(*sources)  # a tuple of the picked items, in C
        index = np.array(sources, dtype=np.int64)
        self._tables = self._tables[index]
        self._columns = {name: column[index] for name, column in self._columns.items()}
        self._block_ids, self._metas = list(gather(self._block_ids)), list(gather(self._metas))
        self._ids = ids

    def _write_sampling(self, row: int, meta: SamplingMeta) -> None:
        columns = self._columns
        for name, field, _ in _COLUMNS:
            columns[name][row] = getattr(meta, field)

    def inputs(self, rows: int, context_blocks: int, block_size: int,
               pending_slots: Mapping[str, int] = MappingProxyType({})) -> Dict[str, torch.Tensor]:
        """The decode call's inputs padded to ``rows`` rows and ``context_blocks`` table entries.
        A ``PENDING_TOKEN`` input is the previous step's token for the same request, still on
        the device: ``feed_slots`` names its slot in the token feed (``pending_slots``); a
        request of a failed previous step has none and gets token 0 (the engine has failed it
        and discards what it computes)."""
        token_ids, num = self._token_ids, len(self._token_ids)
        input_ids = np.zeros(rows, dtype=np.int64)
        positions = np.zeros(rows, dtype=np.int64)
        feed_slots = np.full(rows, NO_FEED, dtype=np.int64)
        if PENDING_TOKEN in token_ids:
            slot_of = pending_slots.get
            feed_slots[:num] = [slot_of(request_id, NO_FEED) if token_id == PENDING_TOKEN else NO_FEED
                                for request_id, token_id in zip(self._ids, token_ids)]
            token_ids = [max(token_id, 0) for token_id in token_ids]
        input_ids[:num] = token_ids
        positions[:num] = self._positions
        tables = self._tables[:rows, :context_blocks].copy()
        slots = np.full(rows, NULL_BLOCK * block_size, dtype=np.int64)
        real = positions[:num]
        slots[:num] = table_slots(tables[:num], real, block_size)
        arrays = [("input_ids", input_ids), ("feed_slots", feed_slots), ("positions", positions),
                  ("slot_mapping", slots), ("block_tables", tables), ("context_lens", positions + 1)]
        if self.lora:
            lora_slots = np.zeros(rows, dtype=np.int64)
            lora_slots[:num] = self._lora_slots
            arrays.append(("lora_slots", lora_slots))
        return {name: torch.from_numpy(array) for name, array in arrays}

    def sampling(self, rows: int) -> Dict[str, torch.Tensor]:
        """The sampler's per-row inputs for the rows, padded greedy to ``rows``. A row's step
        is its sampled token's index among the outputs."""
        num, columns = len(self._ids), self._columns
        tensors = {name: torch.from_numpy(columns[name][:rows].copy()) for name, _, _ in SAMPLING_COLUMNS}
        steps = np.zeros(rows, dtype=np.int64)
        steps[:num] = self._positions + 1 - columns["prompt_len"][:num]
        tensors["steps"] = torch.from_numpy(steps)
        return tensors

    @property
    def request_ids(self) -> Tuple[str, ...]:
        """The rows' requests, in order."""
        return self._ids

    @property
    def wants_logprobs(self) -> bool:
        """Whether a row asked for top log-probs."""
        return bool((self._columns["num_logprobs"][:len(self._ids)] > 0).any())

    @property
    def returns_logprobs(self) -> bool:
        """Whether a row asked for log-probs (0: its sampled token's only)."""
        return bool((self._columns["num_logprobs"][:len(self._ids)] >= 0).any())

    @property
    def all_greedy(self) -> bool:
        """Whether every row samples greedily."""
        return bool((self._columns["temperature"][:len(self._ids)] == 0).all())
