"""What the drafters in the worker share (a draft model, ``worker/draft_model.py``; an EAGLE-3
head, ``worker/eagle3.py``).

A drafter keeps its own KV cache laid out as the target's: block ``b`` of the target's cache
and block ``b`` of the drafter's hold the same positions of the same request, so the target's
block tables address both, and prefix caching and preemption carry over unchanged. Positions
past a request's blocks (its drafts' own) go to scratch blocks after the shared ones, a few per
row; the target never reads them.

After each step's tokens are known, the drafter catches up in packed prefills over what the
step added to each request's text; the last position of a request gives its first draft, and
``k - 1`` greedy decode steps, unrolled in one call, give the others. On the bucketed paths
both take the target's buckets (the catch-up of prompt chunks the plan's prefill graphs, that
of a decode's or a verify's few tokens its decode graphs, a row per token; the steps its decode
graphs of up to ``max_num_seqs`` rows: the plan's ``DraftGraph``s), compiled at warm-up beside
the target's graphs, so nothing compiles while serving. The target verifies the drafts in its
next step (``worker/verify.py``): whatever the drafter proposes, the outputs are the target's.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Callable, ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from tpu_executor.core.buckets import DecodeGraph, DraftGraph, Graph, PrefillGraph, context_keys, graph_label
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PrefillWork, SampledTokens, SamplingMeta, SchedulerOutput
from tpu_executor.models.layers.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata
from tpu_executor.worker.inputs import prefill_inputs, table_slots
from tpu_executor.worker.model_runner import ModelRunner, compile_ahead, compile_step

Drafts = Dict[str, Tuple[int, ...]]
KVCaches = List[Tuple[torch.Tensor, torch.Tensor]]


class StepText(NamedTuple):
    """A request's tokens from ``start``: ``computed`` by the target in the step (those that
    stay in its text), then the step's ``new`` ones."""

    work: object  # the step's PrefillWork or DecodeWork of the request
    start: int
    computed: Tuple[int, ...]
    new: Tuple[int, ...]


class PagedDrafter(abc.ABC):
    """A drafter's model with its own paged KV cache, its catch-up and its greedy steps.
    ``draft`` gives each request of ``step.drafting`` its next ``num_speculative_tokens``
    drafts once the step's tokens are known. A subclass makes the catch-up pack
    (``_catch_up_pack``) and runs its two functions (``_run_catch_up``, ``_run_steps``)."""

    kind = "drafter"  # how messages name it

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, runtime=None,
                 weights: Optional[torch.nn.Module] = None):
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.num_drafts = config.speculative.num_speculative_tokens
        # A row's drafts reach at most num_drafts positions past its blocks.
        self.scratch_per_row = -(-self.num_drafts // self.block_size)
        self.max_rows = config.scheduler.max_num_seqs
        self.kv_caches: KVCaches = []
        self.first_scratch = 0
        self.runner: Optional[ModelRunner] = None
        self.compiles = device.type in ("xla", "jax")
        self.jax_graphs = None
        if runtime is not None:
            from tpu_executor.worker.jax.graphs import JaxGraphs  # imports JAX and torchax

            # ``weights``: the module whose parameters the functions read (the model, or the
            # model with what it borrows from the target).
            self.jax_graphs = JaxGraphs(weights if weights is not None else model, runtime)

    def compiled(self, fn: Callable) -> Callable:
        """``fn`` compiled per bucket on the compiled paths, as is elsewhere."""
        return compile_step(fn, self.jax_graphs, self.model.tp.collectives_in_graph) if self.compiles else fn

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks the draft's cache holds beyond the shared ones."""
        return self.max_rows * self.scratch_per_row

    def reserved_bytes(self, block_bytes: int) -> int:
        """Device bytes the drafter keeps beside the shared blocks (its blocks of
        ``block_bytes`` each): its scratch blocks."""
        return self.num_scratch_blocks * block_bytes

    def device_state(self) -> List[torch.Tensor]:
        """The device buffers the drafter keeps between steps (once ``bind`` gave them): its
        KV cache's pages, scratch blocks included."""
        return [t for layer in self.kv_caches for t in layer]

    def bind(self, runner: ModelRunner, kv_caches: KVCaches, num_shared_blocks: int, zeros: Callable) -> None:
        """``runner`` is the target's (its bucket plan, its recompilation guard and its
        transfers serve the drafter's calls too); ``kv_caches`` the drafter's per-layer K/V
        pages: ``num_shared_blocks`` addressed by the target's block tables, then the scratch
        blocks; ``zeros(shape, dtype)`` makes a device buffer."""
        self.runner = runner
        self.kv_caches = kv_caches
        self.first_scratch = num_shared_blocks

    def capture(self) -> ContextManager:
        """Entered around the target's step: what the drafter reads of the target's calls."""
        return contextlib.nullcontext()

    @torch.no_grad()
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The drafts that follow the tokens of each request of ``step.drafting`` once
        ``sampled`` (the step's tokens) are recorded; every request's step enters the
        drafter's cache."""
        pack = self._catch_up_pack(self._step_texts(step, sampled), self.runner.config.max_model_len)
        rows = self._drafting_rows(step, pack)
        first = self._catch_up(pack, rows)
        return self._greedy_steps([pack[i] for i in rows], first) if rows else {}

    @abc.abstractmethod
    def _catch_up_pack(self, texts: Sequence[StepText], max_model_len: int) -> List[PrefillWork]:
        """The catch-up rows (``is_last_chunk``: the row drafts), none past ``max_model_len``."""

    @abc.abstractmethod
    def _run_catch_up(self, inputs: Dict[str, torch.Tensor], logit_rows: Sequence[Optional[int]]) -> torch.Tensor:
        """Launch the catch-up over a pack's host ``inputs``: the greedy token after each of its
        ``logits_indices``; ``logit_rows`` gives each one's drafting row (None: none)."""

    @abc.abstractmethod
    def _run_steps(self, inputs: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Launch drafts 2 to k over the host ``inputs`` of ``greedy_steps_inputs``."""

    def _catch_up(self, pack: Sequence[PrefillWork], rows: List[int]) -> Dict[str, int]:
        """Run the catch-up pack; each drafting request's first draft. On the bucketed paths a
        short text (a decode's or a verify's) runs decode-shaped, a row per token over its
        block table; prompt chunks run in prefill packs."""
        drafting = {pack[i].request_id: j for j, i in enumerate(rows)}
        if self.runner.plan.exact_sizes:  # one call at its own size
            inputs = self._pack_inputs(pack)
            # The LM head runs over the drafting rows only (a vocabulary-wide matmul).
            inputs["logits_indices"] = inputs["logits_indices"][rows]
            tokens = self._run_catch_up(inputs, list(range(len(rows)))).tolist()
            return {pack[i].request_id: token for i, token in zip(rows, tokens)}
        plan, short_tokens = self.runner.plan, self.num_drafts + 2  # a verify's input, its drafts, its next token
        launched = []
        for piece in self._bucketed_packs([w for w in pack if len(w.token_ids) > short_tokens]):
            graph = plan.pack_graph(piece)
            inputs = prefill_inputs(piece, graph.num_tokens, graph.keys, plan.max_prefill_seqs, self.block_size)
            launched.append(self._launch_catch_up(piece, graph, inputs, drafting))
        for piece in self._row_chunks([w for w in pack if len(w.token_ids) <= short_tokens]):
            graph = plan.catch_up_graph(sum(len(w.token_ids) for w in piece),
                                        max((w.num_context_tokens - 1) // self.block_size + 1 for w in piece))
            launched.append(self._launch_catch_up(piece, graph, catch_up_rows_inputs(piece, graph, self.block_size,
                                                                                     self.max_rows), drafting))
        return {w.request_id: token for piece, tokens in launched
                for w, token in zip(piece, tokens.cpu().tolist()) if w.is_last_chunk}

    def _launch_catch_up(self, piece: Sequence[PrefillWork], graph: Graph, inputs: Dict[str, torch.Tensor],
                         drafting: Dict[str, int]) -> Tuple[Sequence[PrefillWork], torch.Tensor]:
        logit_rows = [drafting.get(w.request_id) if w.is_last_chunk else None for w in piece]
        with self.runner.guard.watch(f"{self.kind} catch-up {graph_label(graph)}"):
            return piece, self._run_catch_up(inputs, logit_rows)

    def _row_chunks(self, works: Sequence[PrefillWork]) -> List[List[PrefillWork]]:
        """``works`` in groups whose tokens fit the largest catch-up row bucket."""
        limit, chunks, rows = self.runner.plan.catch_up_row_buckets[-1], [], 0
        for work in works:
            if not chunks or rows + len(work.token_ids) > limit:
                chunks.append([])
                rows = 0
            chunks[-1].append(work)
            rows += len(work.token_ids)
        return chunks

    def _bucketed_packs(self, pack: Sequence[PrefillWork]) -> List[List[PrefillWork]]:
        """The catch-up rows in packs of the plan's prefill graphs. A row longer than the largest
        token bucket (a full chunk and its new token) runs in pieces, each in a later pack than
        the one before it."""
        plan, packs, rest = self.runner.plan, [], list(pack)
        limit = plan.max_prefill_tokens
        while rest:
            packs += plan.prefill_packs([w._replace(token_ids=w.token_ids[:limit],
                                                    is_last_chunk=w.is_last_chunk and len(w.token_ids) <= limit)
                                         for w in rest])
            rest = [w._replace(token_ids=w.token_ids[limit:], start_pos=w.start_pos + limit)
                    for w in rest if len(w.token_ids) > limit]
        return packs

    def _greedy_steps(self, works: Sequence[PrefillWork], first: Dict[str, int]) -> Drafts:
        """Each drafting row's first draft, then drafts 2 to k in one call after it."""
        firsts = [first[w.request_id] for w in works]
        if self.num_drafts == 1:
            return {w.request_id: (token,) for w, token in zip(works, firsts)}
        positions = [w.num_context_tokens for w in works]
        plan = self.runner.plan
        # The last step's position sets the table width, within the plan's widest.
        needed = (max(positions) + self.num_drafts - 2) // self.block_size + 1
        graph = plan.decode_graph(len(works), min(needed, plan.decode_context_block_buckets[-1]))
        inputs = greedy_steps_inputs(graph, firsts, positions, [w.block_ids for w in works])
        with self.runner.guard.watch(f"{self.kind} {graph_label(graph)}"):
            drafts = self._run_steps(inputs)
        return {w.request_id: (token, *row) for w, token, row in zip(works, firsts, drafts.cpu().tolist())}

    def warmup(self, graphs: Sequence[DraftGraph], show_progress: bool) -> None:
        """Compile the drafter's ``graphs`` (the plan's ``DraftGraph``s)."""
        if not self.compiles:
            return
        if self.jax_graphs is not None:
            compile_ahead(self.jax_graphs, graphs, self._run_dummy, self.runner.compile_threads, show_progress)
            return
        for graph in tqdm(graphs, desc=f"compiling {self.kind} buckets", disable=not show_progress):
            self._run_dummy(graph).cpu()

    def _run_dummy(self, draft_graph: DraftGraph) -> torch.Tensor:
        """Run one of the drafter's graphs on padding-only inputs (writes go to the null block)."""
        graph = draft_graph.graph
        if draft_graph.steps:
            return self._run_steps(greedy_steps_inputs(graph, [], [], []))
        dummy = [PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), SamplingMeta.greedy())]
        if isinstance(graph, PrefillGraph):
            inputs = prefill_inputs(dummy, graph.num_tokens, graph.keys, self.runner.plan.max_prefill_seqs,
                                    self.block_size)
        else:
            inputs = catch_up_rows_inputs(dummy, graph, self.block_size, self.max_rows)
        return self._run_catch_up(inputs, [None] * len(inputs["logits_indices"]))

    def _pack_inputs(self, pack: Sequence[PrefillWork]) -> Dict[str, torch.Tensor]:
        """The catch-up pack's host inputs at its exact size."""
        return prefill_inputs(pack, sum(len(w.token_ids) for w in pack),
                              sum(context_keys(w, self.block_size) for w in pack), len(pack), self.block_size)

    def _step_texts(self, step: SchedulerOutput, sampled: SampledTokens) -> List[StepText]:
        """Per request of the step, its text from the first position the target computed:
        what the target computed that stays (a prompt chunk, a decode's input token, a
        verify's input token: its accepted drafts are among the new tokens), then the new ones."""
        new_tokens = _tokens_by_request(sampled)
        firsts = [(w, w.token_ids, w.start_pos) for w in step.prefills]
        firsts += [(w, (w.token_id,), w.position) for w in step.decodes]
        firsts += [(w, w.token_ids[:1], w.start_pos) for w in step.verifies]
        return [StepText(w, start, tuple(computed), tuple(new_tokens.get(w.request_id, ())))
                for w, computed, start in firsts]

    def _row_work(self, row: int, work, tokens: Tuple[int, ...], start: int, drafts: bool) -> PrefillWork:
        """Row ``row`` of the catch-up pack: ``tokens`` at ``start``, over the request's blocks and
        the row's scratch blocks; ``drafts`` (as ``is_last_chunk``): the row's last position drafts."""
        first = self.first_scratch + row * self.scratch_per_row
        blocks = tuple(work.block_ids) + tuple(range(first, first + self.scratch_per_row))
        return PrefillWork(work.request_id, tokens, start, blocks, work.sampling, drafts)

    def _drafting_rows(self, step: SchedulerOutput, pack: Sequence[PrefillWork]) -> List[int]:
        """The pack's rows that draft: those of ``step.drafting`` with a new token and no
        logits processing (those never speculate)."""
        wanted = set(step.drafting)
        return [i for i, w in enumerate(pack)
                if w.is_last_chunk and w.request_id in wanted and w.sampling.processing is None]


def catch_up_rows_inputs(works: Sequence[PrefillWork], graph: DecodeGraph, block_size: int,
                         num_logits: int) -> Dict[str, torch.Tensor]:
    """A decode-shaped catch-up's host inputs: a row per token of ``works`` over its block
    table, its context ending at its own position, in ``graph``'s shape; the logits of each
    work's last row (``num_logits`` of them, padding reads row 0)."""
    inputs = token_rows_inputs(works, graph.num_rows, graph.context_blocks, block_size)
    logits_indices = np.zeros(num_logits, dtype=np.int64)
    logits_indices[:len(works)] = np.cumsum([len(w.token_ids) for w in works]) - 1
    inputs["logits_indices"] = torch.from_numpy(logits_indices)
    return inputs


def token_rows_inputs(works: Sequence[PrefillWork], num_rows: int, context_blocks: int,
                      block_size: int) -> Dict[str, torch.Tensor]:
    """Decode rows for the tokens of ``works``: a row per token over its work's block table,
    its context ending at its own position; padded to ``num_rows`` rows (reading the null
    block) and ``context_blocks`` table entries."""
    input_ids = np.zeros(num_rows, dtype=np.int64)
    positions = np.zeros(num_rows, dtype=np.int64)
    tables = np.full((num_rows, context_blocks), NULL_BLOCK, dtype=np.int64)
    row = 0
    for work in works:
        num, blocks = len(work.token_ids), work.block_ids[:context_blocks]
        input_ids[row:row + num] = work.token_ids
        positions[row:row + num] = np.arange(work.start_pos, work.start_pos + num)
        tables[row:row + num, :len(blocks)] = blocks
        row += num
    slots = np.full(num_rows, NULL_BLOCK * block_size, dtype=np.int64)
    slots[:row] = table_slots(tables[:row], positions[:row], block_size)
    arrays = {"input_ids": input_ids, "positions": positions, "slot_mapping": slots, "block_tables": tables,
              "context_lens": positions + 1}
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def attention_metadata(positions: torch.Tensor, slot_mapping: torch.Tensor, context_slots=None, key_positions=None,
                       key_segments=None, query_segments=None, block_tables=None,
                       context_lens=None) -> AttentionMetadata:
    """A drafter call's attention inputs: a prefill pack's keys, or decode rows' block tables."""
    if block_tables is not None:
        return AttentionMetadata(positions, slot_mapping, decode=DecodeMetadata(block_tables, context_lens))
    prefill = PrefillMetadata(context_slots, key_positions, key_segments, query_segments)
    return AttentionMetadata(positions, slot_mapping, prefill=prefill)


def greedy_steps_inputs(graph: DecodeGraph, firsts: Sequence[int], positions: Sequence[int],
                        tables: Sequence[Tuple[int, ...]]) -> Dict[str, torch.Tensor]:
    """Host inputs of drafts 2 to k in ``graph``'s shape: each row's first draft, its position
    and its block table (scratch blocks included; cut to the graph's width)."""
    host = {"first_drafts": np.zeros(graph.num_rows, dtype=np.int64),
            "positions": np.zeros(graph.num_rows, dtype=np.int64),
            "block_tables": padded_tables(tables, graph)}
    host["first_drafts"][:len(firsts)] = firsts
    host["positions"][:len(positions)] = positions
    return {name: torch.from_numpy(array) for name, array in host.items()}


def step_slots(positions: torch.Tensor, block_tables: torch.Tensor,
               block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(KV slot, context length) of each row's ``positions`` in its block table, on the device
    (inside a compiled draft step). A position past its row's table (past every limit: such a
    draft is never verified) writes the null block."""
    width = block_tables.shape[1]
    index = positions // block_size
    blocks = block_tables.gather(1, index.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    blocks = torch.where(index < width, blocks, torch.full_like(blocks, NULL_BLOCK))
    return blocks * block_size + positions % block_size, (positions + 1).clamp(max=width * block_size)


def padded_tables(tables: Sequence[Tuple[int, ...]], graph: Optional[DecodeGraph] = None) -> np.ndarray:
    """Block tables as one array, short rows padded with the null block: as wide as the widest
    (as ``graph``'s rows and blocks, long tables cut, when given)."""
    rows, width = (graph.num_rows, graph.context_blocks) if graph else (len(tables), max(map(len, tables)))
    out = np.full((rows, width), NULL_BLOCK, dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :min(len(table), width)] = table[:width]
    return out


def _tokens_by_request(sampled: SampledTokens) -> Dict[str, List[int]]:
    """The step's new tokens of each request, in order (a verify gives several)."""
    tokens: Dict[str, List[int]] = {}
    for request_id, token_id in zip(sampled.request_ids, sampled.token_ids):
        tokens.setdefault(request_id, []).append(token_id)
    return tokens
