"""The bucket plan (pure Python): from the config alone, every padded shape the runner uses
and every graph it compiles.

XLA compiles one graph per input shape, so each dynamic size is padded up to a bucket:

* prefill calls by **tokens** (new tokens of up to ``max_prefill_seqs`` packed prompts or
  prompt chunks) and by **keys** (their cached + new tokens, each context filled to whole
  pages): a call whose keys fit its token bucket plus a page per packed prompt takes that many
  keys (the short form); a longer context (a later chunk of a long prompt, a prefix-cache hit)
  takes a key width from the context buckets,
* decode calls by **rows** (sequences) times **context blocks** (block-table width),
* the sampler by **rows** (decode batch buckets and the prefill pack size), by whether any
  row wants log-probs, and by whether every row is greedy.

Each requested list is cut at the engine's limit, which becomes its last bucket: prefill tokens
at the token budget (chunked prefill) or at ``max_model_len`` (whole prompts), context widths at
``max_model_len``, with widths inserted 4x apart where the requested ones stop far below it.
The runner compiles exactly ``plan.graphs()`` at warm-up; nothing else may compile while serving.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Sequence, Tuple, Union

from tpu_executor.core.step import DecodeWork, PaddingStats, PrefillWork, SchedulerOutput

if TYPE_CHECKING:
    from tpu_executor.core.config import EngineConfig


# The narrowest history graph; wider ones follow 4x apart up to max_model_len.
HISTORY_BUCKET = 256
# Positions whose prompt log-probs one call computes (vocabulary-wide logits for each).
PROMPT_LOGPROB_ROWS = 256


def effective_buckets(requested: Sequence[int], limit: int, multiple: int = 1) -> Tuple[int, ...]:
    """The requested buckets below ``limit`` plus ``limit`` rounded up to ``multiple`` as the last."""
    top = -(-limit // multiple) * multiple
    return tuple(sorted({b for b in requested if b < top} | {top}))


def wide_row_buckets(max_num_seqs: int, tokens_per_seq: int) -> Tuple[int, ...]:
    """Row buckets above ``max_num_seqs`` for a row per token of up to ``max_num_seqs``
    sequences: doubling, then ``max_num_seqs x tokens_per_seq``."""
    limit, buckets, rows = max_num_seqs * tokens_per_seq, [], 2 * max_num_seqs
    while rows < limit:
        buckets.append(rows)
        rows *= 2
    return (*buckets, limit)


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket that holds ``size``."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


def geometric_fill(buckets: Tuple[int, ...], factor: int = 4) -> Tuple[int, ...]:
    """``buckets`` with widths ``factor`` x apart inserted below the last where the gap to
    it is wider than ``factor``: a long context then reads at most ``factor`` x its length."""
    filled = list(buckets[:-1]) or [buckets[-1]]
    while filled[-1] * factor < buckets[-1]:
        filled.append(filled[-1] * factor)
    return tuple(sorted(set(filled) | {buckets[-1]}))


@dataclass(frozen=True)
class PrefillGraph:
    """The model step over one packed prefill row of ``num_tokens`` query tokens attending
    over ``num_keys`` context keys (the plan always sets it; 0 means as many as tokens)."""

    num_tokens: int
    num_keys: int = 0

    @property
    def keys(self) -> int:
        return self.num_keys or self.num_tokens


@dataclass(frozen=True)
class DecodeGraph:
    """The model step over ``num_rows`` sequences with ``context_blocks``-wide block tables,
    ``queries`` tokens each: 1 for a decode; for a verify graph (speculative decoding) a
    sequence's last token and its k drafts, padded at the front to k + 1, attending over the
    sequence's pages in one read."""

    num_rows: int
    context_blocks: int
    queries: int = 1

    @property
    def num_tokens(self) -> int:
        """Token rows of the call (and of the logits it returns)."""
        return self.num_rows * self.queries


@dataclass(frozen=True)
class SamplerGraph:
    """The sampler over ``num_rows`` rows, returning ``num_logprobs`` top log-probs (0: none);
    ``all_greedy`` skips the sort and the noise; ``processing`` applies the rows' penalties,
    bias and masks first (``worker/logits_processing.py``)."""

    num_rows: int
    num_logprobs: int
    all_greedy: bool
    processing: bool = False


@dataclass(frozen=True)
class HistoryGraph:
    """Filling the logits-processing slots of up to ``max_prefill_seqs`` requests from their
    tokens so far, ``num_tokens`` wide."""

    num_tokens: int


@dataclass(frozen=True)
class PromptLogprobsGraph:
    """Prompt log-probs of ``num_rows`` positions of a prefill call's ``num_tokens`` hidden
    states (``worker/prompt_logprobs.py``)."""

    num_tokens: int
    num_rows: int


@dataclass(frozen=True)
class DraftGraph:
    """A drafter's graph (speculative decoding: a draft model or an EAGLE-3 head) over a model
    graph's shapes: its catch-up over a prefill graph's (prompt chunks) or a decode graph's (a
    row per token of short texts), or (``steps``) its greedy steps 2 to k over a decode graph's."""

    graph: Union[PrefillGraph, DecodeGraph]
    steps: bool = False


Graph = Union[PrefillGraph, DecodeGraph, SamplerGraph, HistoryGraph, PromptLogprobsGraph, DraftGraph]


@dataclass(frozen=True)
class PrefillCall:
    """One packed prefill call: its prompts and the graph that runs them."""

    pack: Tuple[PrefillWork, ...]
    graph: PrefillGraph

    @property
    def new_tokens(self) -> int:
        """Tokens the pack computes: what the token bucket is picked by."""
        return sum(len(w.token_ids) for w in self.pack)


    def count_into(self, padding: PaddingStats) -> None:
        padding.prefill_tokens_real += sum(len(w.token_ids) for w in self.pack)
        padding.prefill_tokens_padded += self.graph.num_tokens


@dataclass(frozen=True)
class VerifyCall(PrefillCall):
    """A pack of verifies (speculative decoding) at exact sizes (eager devices): a prefill call
    over each request's last token and drafts, every position through the LM head and sampler."""


@dataclass(frozen=True)
class DecodeCall:
    """The decode call of a step: its rows, the context blocks each row needs, its graph. On
    the bucketed paths a step with verifies (speculative decoding) runs a verify graph: the
    decodes and the verifies are its sequences, each with k + 1 query tokens (a decode's one
    token and a verify's last token and drafts, padded at the front), every query attending
    over its sequence's pages up to its own position (a layer writes every row's K/V before
    any row attends); the sampler graph picks each real position's token. The step reads the
    weights and each sequence's pages once."""

    work: Tuple[DecodeWork, ...]
    needed_blocks: Tuple[int, ...]  # per sequence, the verifies' after the decodes'
    graph: DecodeGraph
    verifies: Tuple[PrefillWork, ...] = ()

    def count_into(self, padding: PaddingStats) -> None:
        padding.decode_rows_real += len(self.needed_blocks)
        padding.decode_rows_padded += self.graph.num_rows
        padding.decode_context_blocks_real += sum(self.needed_blocks)
        padding.decode_context_blocks_padded += len(self.needed_blocks) * self.graph.context_blocks


@dataclass(frozen=True)
class MixedCall:
    """A prefill or verify pack and the decode batch in one model call (eager devices only):
    the pack's tokens first, then one token per decode row."""

    prefill: PrefillCall  # or a VerifyCall
    decode: DecodeCall

    def count_into(self, padding: PaddingStats) -> None:
        self.prefill.count_into(padding)
        self.decode.count_into(padding)


ModelCall = Union[PrefillCall, DecodeCall, MixedCall]


def context_keys(work: PrefillWork, block_size: int) -> int:
    """The keys ``work`` takes in a prefill call: its context (cached + new tokens) filled to
    whole pages (the Pallas kernel reads keys page by page)."""
    return -(-work.num_context_tokens // block_size) * block_size


def pack_prefills(work: Sequence[PrefillWork], max_tokens: int, max_keys: int, max_seqs: int,
                  block_size: int) -> List[List[PrefillWork]]:
    """Group a step's prefills into packs of at most ``max_seqs`` sequences whose new tokens
    add up to at most ``max_tokens`` and whose context keys to at most ``max_keys``.

    First fit, longest first: packs come out fuller, so fewer tokens are padded to a bucket
    (on ``bench throughput``'s workload 4,800 -> 4,608 tokens computed for 4,227 real ones).
    The prefills of one step are independent (a request appears once per step, and blocks
    enter the prefix cache only after their step), so their order is free."""
    packs: List[List[PrefillWork]] = []
    room: List[List[int]] = []  # per pack: tokens, keys and sequences still free
    for item in sorted(work, key=lambda w: -len(w.token_ids)):
        need = (len(item.token_ids), context_keys(item, block_size), 1)
        index = next((i for i, free in enumerate(room) if all(n <= f for n, f in zip(need, free))), None)
        if index is None:
            packs.append([])
            room.append([max_tokens, max_keys, max_seqs])
            index = len(packs) - 1
        packs[index].append(item)
        room[index] = [f - n for f, n in zip(room[index], need)]
    return packs


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket of every dimension, and the graphs they make."""

    prefill_token_buckets: Tuple[int, ...]
    context_token_buckets: Tuple[int, ...]
    decode_row_buckets: Tuple[int, ...]
    decode_context_block_buckets: Tuple[int, ...]
    sampler_row_buckets: Tuple[int, ...]
    logprob_widths: Tuple[int, ...]
    history_token_buckets: Tuple[int, ...]
    max_prefill_seqs: int
    block_size: int
    # Eager devices (the native path) compile nothing: a call runs at its own size (prefill
    # tokens, decode rows and block-table width), and a step's last prefill pack runs with its
    # decodes in one call (``MixedCall``: fewer, larger matmuls, and a new prompt's first token
    # does not wait for a second call). Several ranks keep the buckets and separate calls: when
    # one rank fails a step, the others wait in a collective that the failed rank's next step
    # then meets; at exact sizes gloo aborted the waiting process there, where at bucket sizes
    # the wait ends in the timeout that the executor reports as ranks out of step
    # (executor/test_tensor_parallel.py).
    exact_sizes: bool = False
    # Speculative decoding on the bucketed paths: the query tokens per sequence of the verify
    # graphs (k + 1; 0: no verify graphs), one per decode graph's shape.
    verify_queries: int = 0
    # A drafter's graphs (a draft model or an EAGLE-3 head): its catch-up over each prefill
    # graph's shapes and, a row per token of short texts, over decode shapes of these row
    # buckets; its greedy steps over the decode row buckets (none when it drafts one token).
    draft_model: bool = False
    catch_up_row_buckets: Tuple[int, ...] = ()
    draft_step_rows: Tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "BucketPlan":
        compile_cfg, block_size = config.compile, config.cache.block_size
        rows = effective_buckets(compile_cfg.decode_buckets, config.scheduler.max_num_seqs)
        speculative = config.speculative
        exact_sizes = not config.device.compiles and config.parallel.tensor_parallel_size == 1
        queries = speculative.num_speculative_tokens + 1 if speculative is not None and not exact_sizes else 0
        draft_model = speculative is not None and speculative.model is not None  # a draft model or EAGLE-3 head
        # A drafter's catch-up over short texts takes a row per token (up to k + 2 a sequence,
        # in calls of at most k + 1 rows a sequence).
        catch_up_rows = rows + wide_row_buckets(config.scheduler.max_num_seqs, queries) if draft_model and queries \
            else ()
        context_tokens = geometric_fill(effective_buckets(compile_cfg.decode_context_buckets,
                                                          config.max_model_len, block_size))
        return cls(prefill_token_buckets=prefill_token_buckets(config), context_token_buckets=context_tokens,
                   decode_row_buckets=rows,
                   decode_context_block_buckets=tuple(t // block_size for t in context_tokens),
                   sampler_row_buckets=tuple(sorted(set(rows) | {r * queries for r in rows if queries}
                                                    | {compile_cfg.max_prefill_seqs})),
                   logprob_widths=tuple(sorted({0, compile_cfg.max_logprobs})),
                   history_token_buckets=geometric_fill(effective_buckets((HISTORY_BUCKET,), config.max_model_len)),
                   max_prefill_seqs=compile_cfg.max_prefill_seqs, block_size=block_size,
                   exact_sizes=exact_sizes, verify_queries=queries, draft_model=draft_model,
                   catch_up_row_buckets=catch_up_rows,
                   draft_step_rows=rows if draft_model and speculative.num_speculative_tokens > 1 else ())

    @property
    def max_prefill_tokens(self) -> int:
        """The most new tokens one prefill call computes (the longest chunk)."""
        return self.prefill_token_buckets[-1]

    @property
    def max_prefill_keys(self) -> int:
        """The most context keys one prefill call attends over."""
        return max(self.short_keys(self.prefill_token_buckets[-1]), self.context_token_buckets[-1])

    def short_keys(self, num_tokens: int) -> int:
        """The keys of token bucket ``num_tokens``'s short form: its tokens plus a page per
        packed prompt, room to fill each context to whole pages (the kernel's layout)."""
        return num_tokens + self.max_prefill_seqs * self.block_size

    def long_form_buckets(self) -> Tuple[int, ...]:
        """The token buckets that also run over context widths wider than themselves: the
        largest, then the largest at most a quarter of the one before. A few tokens over a long
        context pad their tokens at most ~4x, and the graph count stays small."""
        chosen = [self.prefill_token_buckets[-1]]
        for bucket in reversed(self.prefill_token_buckets):
            if bucket * 4 <= chosen[-1]:
                chosen.append(bucket)
        return tuple(sorted(set(chosen)))

    def key_widths(self, num_tokens: int) -> Tuple[int, ...]:
        """The key widths of token bucket ``num_tokens``: the short form's, then, for the
        long-form buckets, every context bucket above it."""
        short = self.short_keys(num_tokens)
        if num_tokens not in self.long_form_buckets():
            return (short,)
        return (short,) + tuple(k for k in self.context_token_buckets if k > short)

    def prefill_graph(self, num_tokens: int, num_context: int) -> PrefillGraph:
        """The graph for a pack of ``num_tokens`` new tokens over ``num_context`` keys (its
        contexts filled to whole pages)."""
        if self.exact_sizes:
            return PrefillGraph(num_tokens, num_context)
        buckets = self.prefill_token_buckets
        # Padding queries need a padding key to attend to (a query that sees no key is NaN).
        needed = lambda tokens: num_context + (num_tokens < tokens)  # noqa: E731
        tokens = pick_bucket(buckets, num_tokens)
        if needed(tokens) <= self.short_keys(tokens):
            return PrefillGraph(tokens, self.short_keys(tokens))
        for long_tokens in self.long_form_buckets():
            widths = self.key_widths(long_tokens)[1:]
            if long_tokens >= num_tokens and widths and needed(long_tokens) <= widths[-1]:
                return PrefillGraph(long_tokens, pick_bucket(widths, needed(long_tokens)))
        # Wider than every context width (a pack of several contexts): a larger bucket's short form.
        tokens = next(t for t in buckets if t >= num_tokens and needed(t) <= self.short_keys(t))
        return PrefillGraph(tokens, self.short_keys(tokens))

    def pack_graph(self, pack: Sequence[PrefillWork]) -> PrefillGraph:
        """The graph of one packed prefill call."""
        return self.prefill_graph(sum(len(w.token_ids) for w in pack),
                                  sum(context_keys(w, self.block_size) for w in pack))

    def decode_graph(self, num_rows: int, context_blocks: int, queries: int = 1) -> DecodeGraph:
        """The graph of a decode call of ``num_rows`` sequences, the longest ``context_blocks``
        pages, ``queries`` tokens a sequence (a verify graph's k + 1)."""
        if self.exact_sizes:
            return DecodeGraph(num_rows, context_blocks, queries)
        return DecodeGraph(pick_bucket(self.decode_row_buckets, num_rows),
                           pick_bucket(self.decode_context_block_buckets, context_blocks), queries)

    def catch_up_graph(self, num_rows: int, context_blocks: int) -> DecodeGraph:
        """The decode shape of a drafter's catch-up over ``num_rows`` tokens of short texts."""
        return DecodeGraph(pick_bucket(self.catch_up_row_buckets, num_rows),
                           pick_bucket(self.decode_context_block_buckets, context_blocks))

    def model_calls(self, step: SchedulerOutput) -> List[ModelCall]:
        """The model calls that run ``step``: its prefills packed, then one decode call (a verify
        graph on the bucketed paths when the step verifies). At exact sizes the verifies are one
        packed call, and the last pack and the decodes are one ``MixedCall``."""
        calls: List[ModelCall] = []
        for pack in self.prefill_packs(step.prefills):
            calls.append(PrefillCall(tuple(pack), self.pack_graph(pack)))
        if self.exact_sizes and step.verifies:  # one call for every verify: it reads the weights once
            calls.append(VerifyCall(tuple(step.verifies), self.pack_graph(step.verifies)))
        verifies = () if self.exact_sizes else tuple(step.verifies)
        if step.decodes or verifies:
            needed = tuple(w.position // self.block_size + 1 for w in step.decodes) + tuple(
                (w.start_pos + len(w.token_ids) - 1) // self.block_size + 1 for w in verifies)
            graph = self.decode_graph(len(needed), max(needed), self.verify_queries if verifies else 1)
            calls.append(DecodeCall(step.decodes, needed, graph, verifies))
        if self.exact_sizes and step.decodes and len(calls) > 1:
            calls[-2:] = [MixedCall(calls[-2], calls[-1])]
        return calls

    def prefill_packs(self, works: Sequence[PrefillWork]) -> List[List[PrefillWork]]:
        """``works`` (each within the largest token bucket) in packs that prefill graphs hold."""
        # One key short of the widest: room for the padding key.
        return pack_prefills(works, self.max_prefill_tokens, self.max_prefill_keys - 1, self.max_prefill_seqs,
                             self.block_size)

    def sampler_graph(self, num_rows: int, wants_logprobs: bool, all_greedy: bool,
                      processing: bool = False) -> SamplerGraph:
        """The sampler graph for a model call that returned ``num_rows`` (padded) rows."""
        return SamplerGraph(num_rows, self.logprob_widths[-1] if wants_logprobs else 0, all_greedy, processing)

    def prompt_logprobs_graph(self, num_tokens: int) -> PromptLogprobsGraph:
        """The prompt log-probs graph over a prefill call of ``num_tokens`` (its bucket)."""
        return PromptLogprobsGraph(num_tokens, min(PROMPT_LOGPROB_ROWS, num_tokens))

    def history_graph(self, num_tokens: int) -> HistoryGraph:
        """The graph that fills processing slots from histories of up to ``num_tokens`` tokens."""
        return HistoryGraph(pick_bucket(self.history_token_buckets, num_tokens))

    def describe(self) -> str:
        """The plan as the start-up report prints it: each dimension's buckets and graphs."""
        graphs = self.graphs()

        def count(kind) -> str:
            n = sum(isinstance(g, kind) for g in graphs)
            return f"{n} graph" + ("" if n == 1 else "s")

        tokens = " ".join(map(str, self.prefill_token_buckets))
        rows, widths = (" ".join(map(str, b)) for b in (self.decode_row_buckets, self.context_token_buckets))
        drafts = f"; drafter {count(DraftGraph)}" if self.draft_model else ""
        verify = f", half of them verifying {self.verify_queries} tokens a row" if self.verify_queries else ""
        return (f"prefill {tokens} tokens ({count(PrefillGraph)} with the long-context forms); "
                f"decode {rows} rows x {widths} context tokens ({count(DecodeGraph)}{verify}); "
                f"sampler {count(SamplerGraph)}, "
                f"half of them with logits processing; processing state {count(HistoryGraph)}; "
                f"prompt log-probs {count(PromptLogprobsGraph)}{drafts}")

    def graphs(self) -> List[Graph]:
        """Every graph the runner compiles at warm-up, model steps first."""
        prefill = [PrefillGraph(t, k) for t in self.prefill_token_buckets for k in self.key_widths(t)]
        decode = [DecodeGraph(r, c, q) for q in (1, self.verify_queries) if q for r in self.decode_row_buckets
                  for c in self.decode_context_block_buckets]
        sampler = [SamplerGraph(r, n, g, p) for p in (False, True) for r in self.sampler_row_buckets
                   for n in self.logprob_widths for g in (True, False)]
        history = [HistoryGraph(t) for t in self.history_token_buckets]
        prompt = [self.prompt_logprobs_graph(t) for t in self.prefill_token_buckets]
        catch_up = [DecodeGraph(r, c) for r in self.catch_up_row_buckets for c in self.decode_context_block_buckets]
        drafts = [DraftGraph(g) for g in prefill + catch_up] + [
            DraftGraph(DecodeGraph(r, c), steps=True) for r in self.draft_step_rows
            for c in self.decode_context_block_buckets]
        return [*prefill, *decode, *sampler, *history, *prompt, *(drafts if self.draft_model else ())]


def graph_label(graph: Graph) -> str:
    """A graph of the plan as reports name it, e.g. ``decode rows=8 blocks=32``."""
    if isinstance(graph, DraftGraph):
        return f"draft {'steps' if graph.steps else 'catch-up'} {graph_label(graph.graph)}"
    if isinstance(graph, PrefillGraph):
        return f"prefill tokens={graph.num_tokens} keys={graph.keys}"
    if isinstance(graph, DecodeGraph) and graph.queries > 1:
        return f"verify rows={graph.num_rows} queries={graph.queries} blocks={graph.context_blocks}"
    if isinstance(graph, DecodeGraph):
        return f"decode rows={graph.num_rows} blocks={graph.context_blocks}"
    if isinstance(graph, PromptLogprobsGraph):
        return f"prompt log-probs tokens={graph.num_tokens}"
    if isinstance(graph, HistoryGraph):
        return f"processing state tokens={graph.num_tokens}"
    return (f"sampler rows={graph.num_rows} logprobs={graph.num_logprobs} greedy={graph.all_greedy} "
            f"processing={graph.processing}")


def prefill_token_buckets(config: "EngineConfig") -> Tuple[int, ...]:
    """The prefill token buckets: with chunked prefill cut at the token budget (a chunk never
    exceeds it); without, grown to hold one full-length prompt."""
    requested, block_size = config.compile.prefill_buckets, config.cache.block_size
    if config.scheduler.enable_chunked_prefill:
        return effective_buckets(requested, min(requested[-1], config.scheduler.max_num_batched_tokens), block_size)
    if requested[-1] < config.max_model_len:
        return effective_buckets(requested, config.max_model_len, block_size)
    return requested
