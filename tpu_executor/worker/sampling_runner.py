"""The sampler side of the model runner: the token feed, the logits-processing slots, and the
sampler's compiled functions (plain, processed, and the fill of new requests' slots).

The model runner hands it each call's logits on the device (``sample``); it lays out the
rows' sampling and processing inputs, fills the slots of requests whose history arrives now,
launches the sampler and returns the call's handles (``LaunchedCall``). Its step functions
(``SampleSteps``) are the seam where a benchmark swaps in a sampler of its own.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Dict, Optional, Sequence

import torch

from tpu_executor.core.buckets import BucketPlan, Graph, HistoryGraph, SamplerGraph
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.worker.compile_guard import CompileGuard
from tpu_executor.worker.inputs import sampling_tensors
from tpu_executor.worker.launched_step import LaunchedCall
from tpu_executor.worker.logits_processing import (
    ProcessingRows,
    ProcessingSlots,
    donate,
    empty_processing_rows,
    fill_slots,
    fill_tensors,
    process_logits,
    processed_request_ids,
    record_tokens,
)
from tpu_executor.worker.sampler import sample
from tpu_executor.worker.token_feed import TokenFeed, write_slots
from tpu_executor.worker.transfer import tensor_to_device

HostInputs = Dict[str, torch.Tensor]


class SampleSteps:
    """The sampler's step functions, each compiled as one graph per sampler bucket."""

    @staticmethod
    def sample(logits, slots, feed_tokens, num_logprobs: int, all_greedy: bool, **sampling):
        """Sample, and write the sampled tokens into the token feed."""
        out = sample(logits, num_logprobs=num_logprobs, all_greedy=all_greedy, **sampling)
        return out, write_slots(feed_tokens, slots, out.token_ids)

    @staticmethod
    def sample_processed(logits, slots, feed_tokens, num_logprobs: int, all_greedy: bool, state,
                         rows: ProcessingRows, **sampling):
        """``sample`` over the processed logits; records the tokens in the rows' slots of
        ``state`` (counts, prompt_seen, recent: updated in place)."""
        counts, prompt_seen, recent = state
        donate(counts, recent)
        chosen = process_logits(logits, counts, prompt_seen, recent, rows, sampling["steps"])
        out = sample(logits, num_logprobs=num_logprobs, all_greedy=all_greedy, choice_logits=chosen, **sampling)
        record_tokens(counts, recent, rows.state_slots, out.token_ids)
        return out, write_slots(feed_tokens, slots, out.token_ids)

    @staticmethod
    def fill(state, slots, history, prompt_lens, recent_outputs):
        """Fill new requests' processing slots from their tokens so far."""
        counts, prompt_seen, recent = state
        donate(counts, prompt_seen, recent)
        fill_slots(counts, prompt_seen, recent, slots, history, prompt_lens, recent_outputs)
        return slots.sum()  # something to wait on (warm-up)


class SamplingRunner:
    """Launches the sampler over a model call's logits. ``compile`` makes a step function a
    compiled one; ``put`` copies a call's host inputs to the device (timed by the runner)."""

    def __init__(self, config: EngineConfig, plan: BucketPlan, vocab_size: int, device: torch.device,
                 guard: CompileGuard, compile: Callable, put: Callable[[HostInputs], HostInputs],
                 steps: SampleSteps = SampleSteps()):
        self.plan, self.vocab_size, self.device, self.guard, self.put = plan, vocab_size, device, guard, put
        self.timer = NullPhaseTimer()  # the runner's (see ModelRunner.timer)
        self.feed = TokenFeed(config.scheduler.max_num_seqs, device, in_use=config.scheduler.async_scheduling)
        self.processing = ProcessingSlots(config.scheduler.max_num_seqs, vocab_size, device)
        self._sample_fn = compile(steps.sample)
        self._processed_fn = compile(steps.sample_processed)
        self._fill_fn = compile(steps.fill)

    def begin_step(self, step) -> None:
        """A new step: feed slots start over; absent requests give their processing slots back."""
        self.feed.begin_step()
        self.processing.begin_step(processed_request_ids(step), step.token_bitmasks)

    def sample(self, work: Sequence, sampled_ids: Sequence[Optional[str]], returns_logprobs: bool,
               logits: torch.Tensor, sampling: HostInputs, wants_logprobs: bool, all_greedy: bool) -> LaunchedCall:
        """Launch the sampler over ``logits`` (padded rows) with their ``sampling`` inputs; each
        sampled row writes its token into the feed. ``returns_logprobs``: a row of ``work``
        asked for log-probs (its sampled token's, at least)."""
        rows = logits.shape[0]
        with self.timer.phase("inputs"):
            processing = self.processing.prepare(work, rows)
            graph = self.plan.sampler_graph(rows, wants_logprobs=wants_logprobs, all_greedy=all_greedy,
                                            processing=processing is not None)
        fn, extra = self._sample_fn, {}
        if processing is not None:
            processed, fills = processing
            if fills:
                self._fill(fills)
            fn, extra = partial(self._processed_fn, state=self.processing.state), processed._asdict()
        with self.timer.phase("inputs"):
            slots = self.feed.assign(sampled_ids, graph.num_rows)
        out, self.feed.written_tokens = self._run(fn, {**sampling, **extra, "slots": slots}, logits, graph)
        kept = None if None not in sampled_ids else [row for row, sampled in enumerate(sampled_ids) if sampled]
        return LaunchedCall(work, sampled_ids, returns_logprobs, out, kept)

    def _run(self, fn, host_inputs: HostInputs, logits: torch.Tensor, graph: SamplerGraph):
        inputs = self.put(host_inputs)
        if graph.processing:  # the processed rows travel as one pytree
            inputs["rows"] = ProcessingRows(**{name: inputs.pop(name) for name in ProcessingRows._fields})
        with self.timer.phase("sample"):
            return fn(logits=logits, feed_tokens=self.feed.written_tokens, num_logprobs=graph.num_logprobs,
                      all_greedy=graph.all_greedy, **inputs)

    def _fill(self, fills) -> None:
        """Fill the slots of requests whose history arrives now (one call per fill graph)."""
        width = max(len(history) for _, history, _ in fills)
        graph = self.plan.history_graph(width)
        with self.guard.watch(f"processing state tokens={graph.num_tokens}"), self.timer.phase("inputs"):
            tensors = fill_tensors(fills, self.plan.max_prefill_seqs, graph.num_tokens, self.processing.discard)
        inputs = self.put(tensors)
        with self.timer.phase("sample"):
            self._fill_fn(state=self.processing.state, **inputs)

    def run_dummy(self, graph: Graph) -> torch.Tensor:
        """Run a sampler or fill graph once on padding-only inputs; a tensor to wait on."""
        if isinstance(graph, HistoryGraph):
            tensors = fill_tensors([], self.plan.max_prefill_seqs, graph.num_tokens, self.processing.discard)
            return self._fill_fn(state=self.processing.state, **self.put(tensors))
        rows = graph.num_rows
        logits = tensor_to_device(torch.zeros(rows, self.vocab_size), self.device)  # device data, as in serving
        tensors = dict(sampling_tensors([], rows), slots=self.feed.assign([], rows))
        fn = self._sample_fn
        if graph.processing:
            tensors.update(empty_processing_rows(rows, self.processing)._asdict())
            fn = partial(self._processed_fn, state=self.processing.state)
        out, _ = self._run(fn, tensors, logits, graph)
        return out.token_ids
