"""The bucket plan (pure Python): from the config alone, every padded shape the runner uses
and every graph it compiles.

XLA compiles one graph per input shape, so each dynamic size is padded up to a bucket:

* prefill calls by **tokens** (cached + new tokens of up to ``max_prefill_seqs`` packed prompts),
* decode calls by **rows** (sequences) times **context blocks** (block-table width),
* the sampler by **rows** (decode batch buckets and the prefill pack size), by whether any
  row wants log-probs, and by whether every row is greedy.

Each requested list is cut at the engine's limit, which becomes its last bucket. The runner
compiles exactly ``plan.graphs()`` at warm-up; nothing else may compile while serving.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Sequence, Tuple, Union

if TYPE_CHECKING:
    from tpu_executor.core.config import EngineConfig


def effective_buckets(requested: Sequence[int], limit: int, multiple: int = 1) -> Tuple[int, ...]:
    """The requested buckets below ``limit`` plus ``limit`` rounded up to ``multiple`` as the last."""
    top = -(-limit // multiple) * multiple
    return tuple(sorted({b for b in requested if b < top} | {top}))


def pick_bucket(buckets: Sequence[int], size: int) -> int:
    """The smallest bucket that holds ``size``."""
    index = bisect.bisect_left(buckets, size)
    if index == len(buckets):
        raise ValueError(f"size {size} exceeds the largest bucket {buckets[-1]}")
    return buckets[index]


@dataclass(frozen=True)
class PrefillGraph:
    """The model step over one packed prefill row of ``num_tokens`` tokens."""

    num_tokens: int


@dataclass(frozen=True)
class DecodeGraph:
    """The model step over ``num_rows`` sequences with ``context_blocks``-wide block tables."""

    num_rows: int
    context_blocks: int


@dataclass(frozen=True)
class SamplerGraph:
    """The sampler over ``num_rows`` rows, returning ``num_logprobs`` top log-probs (0: none);
    ``all_greedy`` skips the sort and the noise."""

    num_rows: int
    num_logprobs: int
    all_greedy: bool


Graph = Union[PrefillGraph, DecodeGraph, SamplerGraph]


@dataclass(frozen=True)
class BucketPlan:
    """Every bucket of every dimension, and the graphs they make."""

    prefill_token_buckets: Tuple[int, ...]
    decode_row_buckets: Tuple[int, ...]
    decode_context_block_buckets: Tuple[int, ...]
    sampler_row_buckets: Tuple[int, ...]
    logprob_widths: Tuple[int, ...]
    max_prefill_seqs: int

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "BucketPlan":
        compile_cfg, block_size = config.compile, config.cache.block_size
        prefill = compile_cfg.prefill_buckets
        if prefill[-1] < config.max_model_len:  # one full-length prompt must fit a call
            prefill = effective_buckets(prefill, config.max_model_len, block_size)
        rows = effective_buckets(compile_cfg.decode_buckets, config.scheduler.max_num_seqs)
        context_tokens = effective_buckets(compile_cfg.decode_context_buckets, config.max_model_len, block_size)
        return cls(prefill_token_buckets=prefill, decode_row_buckets=rows,
                   decode_context_block_buckets=tuple(t // block_size for t in context_tokens),
                   sampler_row_buckets=tuple(sorted(set(rows) | {compile_cfg.max_prefill_seqs})),
                   logprob_widths=tuple(sorted({0, compile_cfg.max_logprobs})),
                   max_prefill_seqs=compile_cfg.max_prefill_seqs)

    @property
    def max_prefill_tokens(self) -> int:
        return self.prefill_token_buckets[-1]

    def prefill_graph(self, num_tokens: int) -> PrefillGraph:
        return PrefillGraph(pick_bucket(self.prefill_token_buckets, num_tokens))

    def decode_graph(self, num_rows: int, context_blocks: int) -> DecodeGraph:
        return DecodeGraph(pick_bucket(self.decode_row_buckets, num_rows),
                           pick_bucket(self.decode_context_block_buckets, context_blocks))

    def sampler_graph(self, num_rows: int, wants_logprobs: bool, all_greedy: bool) -> SamplerGraph:
        """The sampler graph for a model call that returned ``num_rows`` (padded) rows."""
        return SamplerGraph(num_rows, self.logprob_widths[-1] if wants_logprobs else 0, all_greedy)

    def graphs(self) -> List[Graph]:
        """Every graph the runner compiles at warm-up, model steps first."""
        prefill = [PrefillGraph(t) for t in self.prefill_token_buckets]
        decode = [DecodeGraph(r, c) for r in self.decode_row_buckets for c in self.decode_context_block_buckets]
        sampler = [SamplerGraph(r, n, g) for r in self.sampler_row_buckets
                   for n in self.logprob_widths for g in (True, False)]
        return [*prefill, *decode, *sampler]
