"""The draft model of speculative decoding (``draft_model``), in the worker, on the native path.

The draft model keeps its own KV cache laid out as the target's: block ``b`` of the target's
cache and block ``b`` of the draft's hold the same positions of the same request, so the
target's block tables address both, and prefix caching and preemption carry over unchanged.

After each step's tokens are known, the draft model computes in one packed prefill, per
request, the tokens the target computed in the step that are now part of its text (a verify's
rejected drafts are left out) followed by the step's new tokens: its last position gives the
request's first draft. Then ``k - 1`` greedy decode steps give the others. Positions past a
request's blocks (its drafts' own) go to scratch blocks after the shared ones, a few per row;
the target never reads them, and the next step's prefill writes the accepted ones again into
the request's blocks. The target verifies the drafts in its next step (``worker/verify.py``):
whatever the draft model proposes, the outputs are the target's.
"""
from __future__ import annotations

import abc
import contextlib
import os
from functools import partial
from typing import ContextManager, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from tqdm import tqdm

from tpu_executor.core.buckets import DecodeGraph, Graph, PrefillGraph, context_keys, graph_label
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.step import PrefillWork, SampledTokens, SamplingMeta, SchedulerOutput
from tpu_executor.worker.inputs import prefill_inputs
from tpu_executor.worker.model_runner import ModelRunner, compile_ahead, compile_step
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.token_feed import NO_FEED

Drafts = Dict[str, Tuple[int, ...]]


class StepText(NamedTuple):
    """A request's tokens from ``start``: ``computed`` by the target in the step (those that
    stay in its text), then the step's ``new`` ones."""

    work: object  # the step's PrefillWork or DecodeWork of the request
    start: int
    computed: Tuple[int, ...]
    new: Tuple[int, ...]


class PagedDrafter(abc.ABC):
    """What the drafters in the worker share: a model with its own KV cache in the target's
    block layout, scratch blocks past the shared ones for draft positions, and the catch-up
    pack of each step's tokens. ``draft`` gives each request of ``step.drafting`` its next
    ``num_speculative_tokens`` drafts once the step's tokens are known."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = device
        self.block_size = config.cache.block_size
        self.num_drafts = config.speculative.num_speculative_tokens
        # A row's drafts reach at most num_drafts positions past its blocks.
        self.scratch_per_row = -(-self.num_drafts // self.block_size)
        self.max_rows = config.scheduler.max_num_seqs
        self.kv_caches: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.first_scratch = 0

    @property
    def num_scratch_blocks(self) -> int:
        """Blocks the draft's cache holds beyond the shared ones."""
        return self.max_rows * self.scratch_per_row

    def bind_kv_caches(self, kv_caches: List[Tuple[torch.Tensor, torch.Tensor]], num_shared_blocks: int,
                       runner: ModelRunner) -> None:
        """The draft's per-layer K/V pages: ``num_shared_blocks`` addressed by the target's
        block tables, then the scratch blocks; ``runner`` is the target's (its bucket plan,
        its recompilation guard and its transfers serve the draft's calls too)."""
        self.kv_caches = kv_caches
        self.first_scratch = num_shared_blocks
        self.runner = runner

    def warmup(self, graphs: Sequence[Graph], show_progress: bool) -> None:
        """Compile the draft's ``graphs`` of the plan (``DraftGraph``), where the drafter compiles."""

    def capture(self) -> ContextManager:
        """Entered around the target's step: what the drafter reads of the target's call."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The next drafts of each request of ``step.drafting``, once ``sampled`` (the step's
        tokens) are recorded."""

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


class DraftModelRunner(PagedDrafter):
    """Runs the draft model beside the target's runner (``draft_model``). On the bucketed
    paths its calls take the target's buckets: the catch-up as packs of the plan's prefill
    graphs, and drafts 2 to k as one graph per decode bucket of up to ``max_num_seqs`` rows
    with the ``k - 1`` greedy steps unrolled; warm-up compiles both beside the target's, so
    nothing compiles while serving."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, runtime=None):
        super().__init__(config, model, device)
        self.steps = ModelSteps(model)
        self.compiles = device.type in ("xla", "jax")
        self.jax_graphs = None
        if runtime is not None:
            from tpu_executor.worker.jax.graphs import JaxGraphs  # imports JAX and torchax

            self.jax_graphs = JaxGraphs(model, runtime)
        fullgraph = model.tp.collectives_in_graph
        compiled = (lambda fn: compile_step(fn, self.jax_graphs, fullgraph)) if self.compiles else (lambda fn: fn)
        self._catch_up_fn = compiled(partial(catch_up_drafts, self.steps))
        self._greedy_steps_fn = compiled(partial(greedy_draft_steps, self.steps, num_steps=self.num_drafts - 1,
                                                 block_size=self.block_size))

    @torch.no_grad()
    def draft(self, step: SchedulerOutput, sampled: SampledTokens) -> Drafts:
        """The drafts that follow the tokens of each request of ``step.drafting`` once
        ``sampled`` (the step's tokens) are recorded. Every request's tokens enter the draft's
        cache; a request drafts from its last one."""
        limit = self.runner.config.max_model_len  # a request ends there: nothing past it drafts
        pack = []
        for row, text in enumerate(self._step_texts(step, sampled)):
            tokens = (text.computed + text.new)[:limit - text.start]
            drafts = bool(text.new) and len(tokens) == len(text.computed) + len(text.new)
            pack.append(self._row_work(row, text.work, tokens, text.start, drafts))
        rows = self._drafting_rows(step, pack)
        first = self._catch_up(pack, rows)
        return self._greedy_steps([pack[i] for i in rows], first) if rows else {}

    def _catch_up(self, pack: Sequence[PrefillWork], rows: List[int]) -> Dict[str, int]:
        """Run the catch-up pack; each drafting request's first draft."""
        runner = self.runner
        if runner.plan.exact_sizes:  # one call at its own size
            inputs = self._pack_inputs(pack)
            # The LM head runs over the drafting rows only (its vocabulary-wide matmul is much of
            # a small draft model's cost).
            inputs["logits_indices"] = inputs["logits_indices"][rows]
            tokens = self._catch_up_fn(**runner.put(inputs), kv_caches=self.kv_caches).tolist()
            return {pack[i].request_id: token for i, token in zip(rows, tokens)}
        launched = []
        for piece in self._bucketed_packs(pack):
            graph = runner.plan.pack_graph(piece)
            inputs = prefill_inputs(piece, graph.num_tokens, graph.keys, runner.plan.max_prefill_seqs, self.block_size)
            with runner.guard.watch(f"draft model {graph_label(graph)}"):
                launched.append((piece, self._catch_up_fn(**runner.put(inputs), kv_caches=self.kv_caches)))
        return {w.request_id: token for piece, tokens in launched
                for w, token in zip(piece, tokens.cpu().tolist()) if w.is_last_chunk}

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
        positions = np.array([w.num_context_tokens for w in works], dtype=np.int64)
        plan = self.runner.plan
        # The last step's position sets the table width, within the plan's widest.
        needed = int(positions.max() + self.num_drafts - 2) // self.block_size + 1
        graph = plan.decode_graph(len(works), min(needed, plan.decode_context_block_buckets[-1]))
        inputs = {"first_drafts": np.zeros(graph.num_rows, dtype=np.int64),
                  "positions": np.zeros(graph.num_rows, dtype=np.int64),
                  "block_tables": padded_tables([w.block_ids for w in works], graph)}
        inputs["first_drafts"][:len(works)] = firsts
        inputs["positions"][:len(works)] = positions
        with self.runner.guard.watch(f"draft model {graph_label(graph)}"):
            drafts = self._greedy_steps_fn(**self.runner.put(_tensors(inputs)), kv_caches=self.kv_caches)
        return {w.request_id: (token, *row) for w, token, row in zip(works, firsts, drafts.cpu().tolist())}

    def warmup(self, graphs: Sequence[Graph], show_progress: bool) -> None:
        """Compile the draft's ``graphs`` (the plan's ``DraftGraph``s: a catch-up per prefill
        graph, the greedy steps per decode graph)."""
        if not self.compiles:
            return
        if self.jax_graphs is not None:
            compile_ahead(self.jax_graphs, graphs, self._run_dummy, self.runner.compile_threads, show_progress,
                          what="draft model ")
            return
        for graph in tqdm(graphs, desc="compiling draft model buckets", disable=not show_progress):
            self._run_dummy(graph).cpu()

    def _run_dummy(self, graph: Graph) -> torch.Tensor:
        """Run the draft's ``graph`` once on padding-only inputs (writes go to the null block)."""
        if isinstance(graph, PrefillGraph):
            dummy = [PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), SamplingMeta.greedy())]
            inputs = prefill_inputs(dummy, graph.num_tokens, graph.keys, self.runner.plan.max_prefill_seqs,
                                    self.block_size)
            return self._catch_up_fn(**self.runner.put(inputs), kv_caches=self.kv_caches)
        inputs = {"first_drafts": np.zeros(graph.num_rows, dtype=np.int64),
                  "positions": np.zeros(graph.num_rows, dtype=np.int64),
                  "block_tables": padded_tables([], graph)}
        return self._greedy_steps_fn(**self.runner.put(_tensors(inputs)), kv_caches=self.kv_caches)


def catch_up_drafts(steps: ModelSteps, kv_caches, **inputs) -> torch.Tensor:
    """The draft model over a catch-up pack (a prefill call's inputs): the greedy token after
    each row (a row that ends with its request's newest token gives the first draft)."""
    logits, _ = steps.prefill(kv_caches=kv_caches, **inputs)
    return logits.argmax(-1)


def greedy_draft_steps(steps: ModelSteps, first_drafts: torch.Tensor, positions: torch.Tensor,
                       block_tables: torch.Tensor, kv_caches, num_steps: int, block_size: int) -> torch.Tensor:
    """``num_steps`` greedy decode steps of the draft model, unrolled in one call, after each
    row's first draft at ``positions``: the rows' next drafts. A position past its row's table
    (past every limit: such a draft is never verified) writes the null block."""
    width = block_tables.shape[1]
    no_feed = torch.full_like(first_drafts, NO_FEED)
    feed = torch.zeros(1, dtype=first_drafts.dtype, device=first_drafts.device)
    tokens, drafts = first_drafts, []
    for step in range(num_steps):
        at = positions + step
        index = at // block_size
        blocks = block_tables.gather(1, index.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
        blocks = torch.where(index < width, blocks, torch.full_like(blocks, NULL_BLOCK))
        logits = steps.decode(input_ids=tokens, feed_slots=no_feed, feed_tokens=feed, positions=at,
                              slot_mapping=blocks * block_size + at % block_size, block_tables=block_tables,
                              context_lens=(at + 1).clamp(max=width * block_size), kv_caches=kv_caches)
        tokens = logits.argmax(-1)
        drafts.append(tokens)
    return torch.stack(drafts, dim=1)


def _tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def _tokens_by_request(sampled: SampledTokens) -> Dict[str, List[int]]:
    """The step's new tokens of each request, in order (a verify gives several)."""
    tokens: Dict[str, List[int]] = {}
    for request_id, token_id in zip(sampled.request_ids, sampled.token_ids):
        tokens.setdefault(request_id, []).append(token_id)
    return tokens


def padded_tables(tables: Sequence[Tuple[int, ...]], graph: Optional[DecodeGraph] = None) -> np.ndarray:
    """Block tables as one array, short rows padded with the null block: as wide as the widest
    (as ``graph``'s rows and blocks, long tables cut, when given)."""
    rows, width = (graph.num_rows, graph.context_blocks) if graph else (len(tables), max(map(len, tables)))
    out = np.full((rows, width), NULL_BLOCK, dtype=np.int64)
    for row, table in enumerate(tables):
        out[row, :min(len(table), width)] = table[:width]
    return out


def check_draft_checkpoint(target_path: str, draft_path: str) -> None:
    """Refuse a draft checkpoint whose tokens are not the target's: another vocabulary size,
    or (where both ship a ``tokenizer.json``) another vocabulary."""
    from tokenizers import Tokenizer

    from tpu_executor.worker.model_loader import load_hf_config

    if not os.path.isfile(os.path.join(draft_path, "config.json")):
        raise ValueError(f"speculative_config model {draft_path!r} is not a checkpoint directory (no config.json)")
    target_vocab = load_hf_config(target_path).vocab_size
    draft_vocab = load_hf_config(draft_path).vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"the draft model {draft_path!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{target_vocab}: a draft model must share the target's tokenizer")
    files = [os.path.join(path, "tokenizer.json") for path in (target_path, draft_path)]
    if all(os.path.isfile(f) for f in files):
        target_tokens, draft_tokens = (Tokenizer.from_file(f).get_vocab() for f in files)
        if draft_tokens != target_tokens:
            raise ValueError(f"the draft model {draft_path!r} has another tokenizer than the target (their "
                             "tokenizer.json vocabularies differ): a draft model must share the target's tokenizer")
