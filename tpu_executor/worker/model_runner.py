"""Model runner: pads scheduled work to the buckets of the plan, runs the compiled model step,
then the separately compiled sampler (graph counts add instead of multiplying).

A prefill call packs up to ``max_prefill_seqs`` prompts into one row padded to a prefill
bucket; a decode call runs a batch padded to a (rows, context blocks) bucket. On the native
path (a torch device) the same code runs eagerly, at exact sizes, and a step's last pack and
its decodes run as one mixed call.

A step is launched (inputs built, copied, every call handed to the device) and collected
(tokens read back) in two moves. On XLA a compiled call returns once it is queued, so with
asynchronous scheduling the worker launches step N+1 before it collects step N: the device
goes from one step to the next without waiting for the host. Step N's tokens reach step N+1's
decode inputs on the device, through the token feed (``worker/token_feed.py``).
"""
from __future__ import annotations

import logging
import os
import statistics
import time
from functools import partial
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from tqdm import tqdm

from tpu_executor.core.buckets import (
    BucketPlan,
    DecodeCall,
    DecodeGraph,
    DraftGraph,
    Graph,
    MixedCall,
    PrefillCall,
    PrefillGraph,
    PromptLogprobsGraph,
    VerifyCall,
    graph_label,
)
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.kv_cache_manager import NULL_BLOCK
from tpu_executor.core.phase_timer import NullPhaseTimer
from tpu_executor.core.step import DecodeWork, PaddingStats, PrefillWork, SamplingMeta, SchedulerOutput
from tpu_executor.kernels import REGISTRY
from tpu_executor.worker.compile_guard import CompileGuard, jax_compile_events, raise_dynamo_limits
from tpu_executor.worker.decode_batch import PersistentDecodeBatch
from tpu_executor.worker.inputs import mixed_inputs, prefill_inputs, sampling_tensors
from tpu_executor.worker.launched_step import LaunchedCall, LaunchedStep
from tpu_executor.worker.model_steps import ModelSteps
from tpu_executor.worker.prompt_logprobs import groups, owed_positions, padding_group, prompt_logprobs_step
from tpu_executor.worker.sampling_runner import SampleSteps, SamplingRunner
from tpu_executor.worker.transfer import tensor_to_device, to_device
from tpu_executor.worker.verify import verify_positions, verify_query_inputs, verify_rows, verify_step

logger = logging.getLogger(__name__)

KVCaches = List[Tuple[torch.Tensor, torch.Tensor]]


class ModelRunner:
    """Runs scheduled work on one device and returns one sampled token per request. The model's
    step functions come from ``model_steps_class``, the sampler's from ``sample_steps``: the
    seams where a benchmark runs the engine without a model, or on a simulated device."""

    model_steps_class = ModelSteps
    sample_steps = SampleSteps()

    def __init__(self, config: EngineConfig, model: torch.nn.Module, device: torch.device, runtime=None):
        self.config = config
        self.model = model
        self.device = device
        self.runtime = runtime  # the JAX path's JaxRuntime (worker/jax/runtime.py), else None
        self.plan = BucketPlan.from_config(config)
        self.block_size = config.cache.block_size
        self.kv_caches: KVCaches = []
        compiled = device.type in ("xla", "jax")
        events = jax_compile_events() if runtime is not None else None
        self.kernel_providers: Tuple[Tuple[str, str], ...] = ()  # (op, provider) at warm-up
        self.guard = CompileGuard(config.compile.strict, enabled=compiled,
                                  **({} if events is None else dict(counts=events.counts,
                                                                    cache_figures=events.cache_figures)))
        self.jax_graphs = None
        if runtime is not None:
            from tpu_executor.worker.jax.graphs import JaxGraphs  # imports JAX and torchax

            self.jax_graphs = JaxGraphs(model, runtime)
        self.padding = PaddingStats()
        self.taps = None  # where the model calls copy an EAGLE-3 head's inputs (``use_taps``)
        # On XLA a call only queues work: reading tokens back can wait for the next launch.
        self.compiled = compiled
        self.collects_late = compiled
        self.sampling = SamplingRunner(config, self.plan, model.config.vocab_size, device, self.guard,
                                       partial(self._compile, compiled=compiled, fullgraph=True), self.put,
                                       self.sample_steps)
        self.timer = NullPhaseTimer()  # see LLMEngine.attach_phase_timer
        self.lora = config.lora.enable_lora  # the model calls take each token's adapter slot
        self.decode_batch = PersistentDecodeBatch(self.plan.decode_row_buckets[-1],
                                                  self.plan.decode_context_block_buckets[-1], self.lora)
        if device.type == "xla":
            raise_dynamo_limits(len(self.plan.graphs()))
        # Host-side collectives (gloo on CPU) split the model step into one graph per piece
        # between collectives; each piece is still compiled once per bucket.
        one_graph = model.tp.collectives_in_graph
        self.steps = self.model_steps_class(model)
        self._prefill_fn = self._compile(self.steps.prefill, compiled, one_graph)
        self._decode_fn = self._compile(self.steps.decode, compiled, one_graph)
        self._mixed_fn = self.steps.mixed  # eager devices only
        self._prompt_logprobs_fn = self._compile(partial(prompt_logprobs_step, model), compiled, one_graph)
        self._verify_fn = partial(verify_step, model)  # eager devices only

    @property
    def timer(self):
        """The phase timer of the runner and its sampler side."""
        return self.sampling.timer

    @timer.setter
    def timer(self, timer) -> None:
        self.sampling.timer = timer

    def _compile(self, fn, compiled: bool, fullgraph: bool):
        return compile_step(fn, self.jax_graphs, fullgraph) if compiled else fn

    def use_taps(self, taps) -> None:
        """Copy the inputs of ``taps.layer_ids`` out of every model call into ``taps.buffers``
        (an EAGLE-3 head's inputs; ``worker/hidden_taps.py``), before warm-up compiles."""
        self.taps = taps
        self.steps.tap_layers = taps.layer_ids

    def bind_kv_caches(self, kv_caches: KVCaches) -> None:
        """The per-layer K/V pages every later step reads and writes in place."""
        self.kv_caches = kv_caches

    @torch.no_grad()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """Run the prefills (packed), then the decode batch, and sample one token for each,
        without reading anything back (on XLA this returns once the work is queued)."""
        self.sampling.begin_step(step)
        calls = []
        try:
            for call in self.plan.model_calls(step):
                call.count_into(self.padding)
                if isinstance(call, MixedCall):
                    calls.extend(self._launch_mixed(call))
                elif isinstance(call, VerifyCall):
                    calls.append(self._launch_verify(call))
                else:
                    calls.append(self._launch_prefill(call) if isinstance(call, PrefillCall)
                                 else self._launch_decode(call))
        except BaseException:
            self.sampling.feed.forget()
            raise
        return LaunchedStep(calls, self.timer)

    def _prefill_host_inputs(self, pack: Sequence[PrefillWork], graph: PrefillGraph) -> Dict[str, torch.Tensor]:
        # At exact sizes one call takes every verify of a step, however many.
        max_seqs = max(len(pack), self.plan.max_prefill_seqs) if self.plan.exact_sizes else self.plan.max_prefill_seqs
        return prefill_inputs(pack, graph.num_tokens, graph.keys, max_seqs, self.block_size, self.lora)

    def _decode_host_inputs(self, work: Sequence[DecodeWork], graph: DecodeGraph,
                            verifies: Sequence[PrefillWork] = ()) -> Dict[str, torch.Tensor]:
        """A decode graph's inputs, or a verify graph's (the decodes, then ``verifies``)."""
        batch, pending = self.decode_batch, self.sampling.feed.pending_slots
        if graph.queries == 1:
            batch.update(work)
            return batch.inputs(graph.num_rows, graph.context_blocks, self.block_size, pending)
        decodes = None
        if work:  # the batch keeps its rows through steps of verifies only
            batch.update(work)
            decodes = batch.inputs(len(work), graph.context_blocks, self.block_size, pending)
        return verify_query_inputs(decodes, verifies, graph, self.block_size, self.lora)

    def _prefill_logits(self, pack: Sequence[PrefillWork], graph: PrefillGraph, kv_caches: KVCaches) -> torch.Tensor:
        with self.timer.phase("inputs"):
            inputs = self._prefill_host_inputs(pack, graph)
        return self._run_fn(self._prefill_fn, inputs, "prefill", kv_caches=kv_caches)

    def _decode_logits(self, work: Sequence[DecodeWork], graph: DecodeGraph,
                       verifies: Sequence[PrefillWork] = ()) -> torch.Tensor:
        with self.timer.phase("inputs"):
            inputs = self._decode_host_inputs(work, graph, verifies)
        return self._run_fn(self._decode_fn, inputs, "decode", feed_tokens=self.sampling.feed.read_tokens,
                            kv_caches=self.kv_caches)

    def put(self, host_inputs: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``host_inputs`` on the device, in one transfer."""
        with self.timer.phase("transfer"):
            return self.runtime.put(host_inputs) if self.runtime is not None else to_device(host_inputs, self.device)

    def _run_fn(self, fn, host_inputs: Dict[str, torch.Tensor], phase: str, **static):
        """Copy ``host_inputs`` to the device and call ``fn`` on them (timed as ``phase``)."""
        if not self.compiled and "lora_slots" in host_inputs and not host_inputs["lora_slots"].any():
            # Eager: a call with no adapter's token skips the LoRA products (compiled graphs keep their inputs).
            host_inputs = {name: t for name, t in host_inputs.items() if name != "lora_slots"}
        if self.taps is not None and "slot_mapping" in host_inputs:  # a model step
            host_inputs = {**host_inputs, "tap_rows": self.taps.rows_for(host_inputs["slot_mapping"])}
            static = {**static, "tap_buffers": self.taps.buffers}
        inputs = self.put(host_inputs)
        with self.timer.phase(phase):
            return fn(**inputs, **static)

    def _launch_prefill(self, call: PrefillCall) -> LaunchedCall:
        with self.guard.watch(f"prefill bucket tokens={call.graph.num_tokens} keys={call.graph.keys}"):
            logits, hidden = self._prefill_logits(call.pack, call.graph, self.kv_caches)
            return self._sample_prefill(call, logits, hidden)

    def _sample_prefill(self, call: PrefillCall, logits: torch.Tensor, hidden: torch.Tensor) -> LaunchedCall:
        """Launch the pack's prompt log-probs and the sampler over its rows' ``logits``."""
        prompt = self._launch_prompt_logprobs(call, hidden)
        # A chunk that does not end its prompt gives no token (its row is sampled with the rest).
        sampled_ids = [w.request_id if w.is_last_chunk else None for w in call.pack]
        with self.timer.phase("inputs"):
            sampling = sampling_tensors(call.pack, self.plan.max_prefill_seqs)
        launched = self.sampling.sample(
            call.pack, sampled_ids, any(item.sampling.num_logprobs >= 0 for item in call.pack), logits, sampling,
            wants_logprobs=any(item.sampling.num_logprobs > 0 for item in call.pack),
            all_greedy=all(item.sampling.temperature == 0 for item in call.pack))
        return launched._replace(prompt=prompt)

    def _launch_prompt_logprobs(self, call: PrefillCall, hidden: torch.Tensor) -> list:
        """Launch the prompt log-probs the pack's chunks owe, in groups; [] when none."""
        owed = owed_positions(call.pack)
        if not owed.owners:
            return []
        graph = self.plan.prompt_logprobs_graph(call.graph.num_tokens)
        width = max(1, self.config.compile.max_logprobs)
        launched = []
        with self.guard.watch(f"prompt log-probs tokens={graph.num_tokens}"):
            for tensors, owners in groups(owed, graph.num_rows):
                launched.append((self._run_fn(self._prompt_logprobs_fn, tensors, "prefill", hidden=hidden,
                                              num_logprobs=width), owners))
        return launched

    def _launch_verify(self, call: VerifyCall) -> LaunchedCall:
        """The target's tokens at every position of a pack of verifies (speculative decoding),
        eager: the model, the LM head and the sampler over the rows in one call."""
        with self.timer.phase("inputs"):
            inputs = {**self._prefill_host_inputs(call.pack, call.graph),
                      **self._verify_inputs(call, call.graph.num_tokens)}
        out = self._run_fn(self.steps.verify, inputs, "prefill", kv_caches=self.kv_caches, **self._verify_static(call))
        return self._launched_verify(call, out)

    def _verify_hidden(self, call: VerifyCall, hidden: torch.Tensor, num_rows: int) -> LaunchedCall:
        """The LM head and the sampler over a verify pack's ``hidden`` states (``num_rows`` rows)."""
        with self.timer.phase("inputs"):
            inputs = self._verify_inputs(call, num_rows)
        out = self._run_fn(self._verify_fn, inputs, "prefill", hidden=hidden, **self._verify_static(call))
        return self._launched_verify(call, out)

    @staticmethod
    def _launched_verify(call: VerifyCall, out) -> LaunchedCall:
        """A verify's handles: a row per position of its pack, the accepted ones kept at collection."""
        request_ids = [w.request_id for w in call.pack for _ in w.token_ids]
        returns_logprobs = any(w.sampling.num_logprobs >= 0 for w in call.pack)
        return LaunchedCall(verify_positions(call.pack), request_ids, returns_logprobs, out, None, verified=call.pack)

    @staticmethod
    def _verify_inputs(call: VerifyCall, num_rows: int) -> Dict[str, torch.Tensor]:
        """A verify's rows of the pack's hidden states and their sampler inputs."""
        return {"rows": verify_rows(call.pack, num_rows), **sampling_tensors(verify_positions(call.pack), num_rows)}

    def _verify_static(self, call: VerifyCall) -> Dict[str, object]:
        """The verify's constants: the log-prob width, and whether every row is greedy."""
        return dict(num_logprobs=self.plan.logprob_widths[-1],
                    all_greedy=all(w.sampling.temperature == 0 for w in call.pack))

    def _launch_decode(self, call: DecodeCall) -> LaunchedCall:
        graph = call.graph
        with self.guard.watch(f"{graph_label(graph)} bucket"):
            if call.verifies:
                return self._decode_rows_and_verifies(graph, call.work, call.verifies)
            return self._sample_decode(call, self._decode_logits(call.work, graph))

    def _decode_rows_and_verifies(self, graph: DecodeGraph, work: Sequence[DecodeWork],
                                  pack: Sequence[PrefillWork]) -> LaunchedCall:
        """The decodes of ``work`` and the verifies of ``pack`` in one verify graph and one
        sampler graph over the decodes' rows, then every position of the verifies: the
        weights and each sequence's pages are read once."""
        batch, num_decodes, positions = self.decode_batch, len(work), verify_positions(pack)
        logits = self._decode_logits(work, graph, pack)
        with self.timer.phase("inputs"):
            sampling = sampling_tensors(positions, graph.num_tokens - num_decodes)
            if work:
                sampling = {name: torch.cat([t, sampling[name]]) for name, t in batch.sampling(num_decodes).items()}
        decoded = bool(work)
        launched = self.sampling.sample(
            list(work) + positions, list(batch.request_ids if decoded else ()) +
            [w.request_id for w in pack for _ in w.token_ids],
            (decoded and batch.returns_logprobs) or any(w.sampling.num_logprobs >= 0 for w in pack), logits, sampling,
            wants_logprobs=(decoded and batch.wants_logprobs) or any(w.sampling.num_logprobs > 0 for w in pack),
            all_greedy=(not decoded or batch.all_greedy) and all(w.sampling.temperature == 0 for w in pack))
        return launched._replace(verified=pack, verified_from=num_decodes)

    def _sample_decode(self, call: DecodeCall, logits: torch.Tensor) -> LaunchedCall:
        """Launch the sampler over the decode rows' ``logits``."""
        batch = self.decode_batch
        with self.timer.phase("inputs"):
            sampling = batch.sampling(call.graph.num_rows)
        return self.sampling.sample(call.work, batch.request_ids, batch.returns_logprobs, logits, sampling,
                                    wants_logprobs=batch.wants_logprobs, all_greedy=batch.all_greedy)

    def _launch_mixed(self, call: MixedCall) -> List[LaunchedCall]:
        """One model call over a prefill pack and the decode rows (eager devices: nothing is
        compiled, so no guard), then the two samplers, as the separate calls would run them."""
        prefill, decode = call.prefill, call.decode
        with self.timer.phase("inputs"):
            inputs = mixed_inputs(self._prefill_host_inputs(prefill.pack, prefill.graph),
                                  self._decode_host_inputs(decode.work, decode.graph))
        prefill_logits, decode_logits, hidden = self._run_fn(
            self._mixed_fn, inputs, "mixed", feed_tokens=self.sampling.feed.read_tokens, kv_caches=self.kv_caches)
        if isinstance(prefill, VerifyCall):
            first = self._verify_hidden(prefill, hidden, sum(len(w.token_ids) for w in prefill.pack))
        else:
            first = self._sample_prefill(prefill, prefill_logits, hidden)
        return [first, self._sample_decode(decode, decode_logits)]

    @torch.no_grad()
    def profile_run(self, kv_caches: KVCaches) -> None:
        """Run the largest prefill once over ``kv_caches`` (a minimal cache: one full-length
        sequence) so that the peak activation memory shows in the device's memory figures."""
        keys = min(self.plan.max_prefill_keys, self.config.max_model_len)
        tokens = min(self.plan.max_prefill_tokens, keys)
        work = PrefillWork("profile", tuple([0] * tokens), keys - tokens,
                           tuple(range(1, self.config.max_blocks_per_seq + 1)), SamplingMeta.greedy())
        self._prefill_logits([work], self.plan.pack_graph([work]), kv_caches)[0].cpu()

    @torch.no_grad()
    def warmup(self, show_progress: bool = True, graphs: Optional[Sequence[Graph]] = None, drafter=None) -> None:
        """Compile every graph of the bucket plan (or ``graphs`` of it), with a progress bar,
        noting the provider each kernel op got (``kernel_providers``); then the graphs of the
        ``drafter`` that runs beside the model (the plan's draft model graphs), if any."""
        self.guard.begin_warmup()
        graphs = self.plan.graphs() if graphs is None else graphs
        drafts = [g for g in graphs if isinstance(g, DraftGraph)]
        graphs = [g for g in graphs if not isinstance(g, DraftGraph)]
        with REGISTRY.recording() as selections:
            if self.jax_graphs is not None:
                # Compiled, not run: nothing is left to do at a first call.
                compile_ahead(self.jax_graphs, graphs, self._run_dummy, self.compile_threads, show_progress)
                self._report_kernels()
            else:
                for graph in tqdm(graphs, desc="compiling buckets", disable=not show_progress):
                    self._run_dummy(graph)
            if drafter is not None and drafts:
                drafter.warmup(drafts, show_progress)
        self.guard.end_warmup()
        chosen = ({(c.op, c.provider) for c in self.jax_graphs.kernel_choices()} if self.jax_graphs is not None
                  else {(s.op, s.provider.name) for s in selections})
        self.kernel_providers = tuple(sorted(chosen))

    @torch.no_grad()
    def note_kernels(self) -> None:
        """Eager devices, where nothing compiles: run one padding prefill and one decode row,
        noting the provider each kernel op got (``kernel_providers``; the first call of a C
        kernel builds it, so serving's first step does not)."""
        prompt = [PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), SamplingMeta.greedy())]
        with REGISTRY.recording() as selections:
            self._run_dummy(self.plan.pack_graph(prompt))
            self._run_dummy(self.plan.decode_graph(1, 1))
        self.kernel_providers = tuple(sorted({(s.op, s.provider.name) for s in selections}))

    def _report_kernels(self) -> None:
        """Log the provider each op got in the compiled graphs; on a TPU, each op and shape where
        a Pallas kernel refused a bucket is a warning (an error with ``strict_kernels``): a
        silent fallback to the reference costs speed."""
        from tpu_executor.worker.jax.programs import refusal_lines

        choices = self.jax_graphs.kernel_choices()
        chosen = sorted({(c.op, c.provider) for c in choices})
        logger.info("kernel providers: %s", ", ".join(f"{op}={provider}" for op, provider in chosen))
        if self.jax_graphs.platform != "tpu":
            return
        lines = refusal_lines(choices)
        for line in lines if not self.runtime.abstract else ():  # a compile for a slice reports them itself
            logger.warning("Pallas kernel refused: %s", line)
        if lines and self.config.compile.strict_kernels:
            raise ValueError(f"strict_kernels: {len(lines)} op calls fall back from their Pallas kernel, "
                             f"first: {lines[0]}")

    @property
    def compile_threads(self) -> int:
        """XLA compiles at once on the JAX path's warm-up."""
        if self.jax_graphs is not None and self.jax_graphs.platform == "tpu":
            # libtpu crashes the process now and then when two of its compiles run at once
            # (0.0.21: SIGSEGV; 0.0.42.1: a stack overflow in the SparseCore code generator for
            # v6e and v7x); one at a time it compiles every graph of every architecture.
            return 1
        return self.config.compile.compile_threads or os.cpu_count() or 1

    @torch.no_grad()
    def time_graph(self, graph: Graph, repeats: int) -> float:
        """Median seconds of one run of ``graph`` on padding-only inputs (compiled already)."""
        self._run_dummy(graph)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self._run_dummy(graph)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _run_dummy(self, graph: Graph) -> None:
        """Run ``graph`` once on padding-only inputs (writes go to the null block)."""
        run = {PrefillGraph: self._dummy_prefill, PromptLogprobsGraph: self._dummy_prompt_logprobs,
               DecodeGraph: self._dummy_decode}.get(type(graph), self.sampling.run_dummy)
        self._wait(run(graph))

    def _dummy_prefill(self, graph: PrefillGraph) -> torch.Tensor:
        dummy = [PrefillWork("warmup", (0,), 0, (NULL_BLOCK,), SamplingMeta.greedy())]
        return self._prefill_logits(dummy, graph, self.kv_caches)[0]

    def _dummy_prompt_logprobs(self, graph: PromptLogprobsGraph) -> torch.Tensor:
        hidden = tensor_to_device(torch.zeros(graph.num_tokens, self.model.config.hidden_size), self.device)
        return self._run_fn(self._prompt_logprobs_fn, padding_group(graph.num_rows), "prefill", hidden=hidden,
                            num_logprobs=max(1, self.config.compile.max_logprobs))[0]

    def _dummy_decode(self, graph: DecodeGraph) -> torch.Tensor:
        return self._decode_logits([DecodeWork("warmup", 0, 0, (NULL_BLOCK,), SamplingMeta.greedy())], graph)

    def _wait(self, tensor: torch.Tensor) -> None:
        """Wait for a warm-up call (compiling ahead there is nothing to wait for: the call
        answered with zeros, which are no more than shapes when compiling for another machine)."""
        if self.jax_graphs is None or not self.jax_graphs.compiling_ahead:
            tensor.cpu()


def compile_step(fn, jax_graphs, fullgraph: bool):
    """``fn`` compiled per input shape: by ``jax_graphs`` on the JAX path, else by torch_xla's
    dynamo backend (``fullgraph``: one graph, no collectives on the host between pieces)."""
    if jax_graphs is not None:
        return jax_graphs.function(fn)
    return torch.compile(fn, backend="openxla", fullgraph=fullgraph, dynamic=False)


def compile_ahead(jax_graphs, graphs: Sequence[Graph], run_dummy, threads: int, show_progress: bool) -> None:
    """JAX path: trace each of ``graphs`` through ``run_dummy`` (or read its traced program
    back), handing each to a pool of ``threads`` where XLA compiles several at once (or loads
    it from the cache)."""
    with jax_graphs.ahead_of_time(threads) as compiling:
        with tqdm(total=len(graphs), desc="tracing buckets", disable=not show_progress) as bar:
            for graph in graphs:
                jax_graphs.label = graph_label(graph)
                run_dummy(graph)
                bar.update()
        for future in tqdm(compiling, desc=f"compiling buckets ({threads} threads)", disable=not show_progress):
            future.result()
