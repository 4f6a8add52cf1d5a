"""A worker owns one device: it loads the model there, sizes and allocates the KV cache, and
runs the model runner. ``init_device`` is the only place that reads or sets device
environment variables. Executors call the methods named in ``executor/base.py``.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
from typing import Deque, List, Optional, Tuple

import torch

from tpu_executor.core.buckets import Graph
from tpu_executor.core.config import EngineConfig, tpu_attached
from tpu_executor.core.step import ModelRunnerOutput, SchedulerOutput, WorkerStats
from tpu_executor.models.layers.parallel import SingleRank, TensorParallelGroup
from tpu_executor.worker.compile_caches import init_xla_compile_cache, use_jax_caches
from tpu_executor.worker.distributed import GlooGroup, RankPlacement, XlaGroup, tpu_topology_env
from tpu_executor.worker.draft_model import DraftModelRunner, check_draft_checkpoint
from tpu_executor.worker.eagle3 import Eagle3Runner
from tpu_executor.worker.launched_step import LaunchedStep, WithLoRAFailures
from tpu_executor.worker.lora_loader import AdapterStore, enable_lora
from tpu_executor.worker.model_loader import load_eagle3_head, load_model, pack_for_cpu, use_xla_cpu_forms
from tpu_executor.worker.model_runner import ModelRunner
from tpu_executor.worker.paged_drafter import PagedDrafter

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    """One device's share of the engine: rank ``placement.rank`` of the tensor-parallel group.

    The Ray executor runs one per chip inside an actor; the in-process executor runs one.
    ``runner_class`` is the model runner it builds (``bench host`` swaps in one without a model).
    """

    runner_class = ModelRunner

    def __init__(self, config: EngineConfig, placement: RankPlacement = RankPlacement()):
        self.config = config
        self.placement = placement
        self.dtype = _DTYPES[config.model.dtype]
        self.device: Optional[torch.device] = None
        self.tp: TensorParallelGroup = SingleRank()
        self.model = None
        self.weight_bytes = 0
        self.kv_cache_bytes = 0
        self.runner: Optional[ModelRunner] = None
        self.drafter: Optional[PagedDrafter] = None  # the draft model's or EAGLE-3 head's runner
        self.adapters: Optional[AdapterStore] = None  # multi-LoRA: the adapters read, written into slots
        self.jax = None  # the JAX path's JaxRuntime (device, mesh, torchax environment)
        self.aot_job = None  # the JAX path's executables compiled ahead of time, when found
        # Launched, not yet collected: each step with its handles.
        self._launched: Deque[Tuple[SchedulerOutput, LaunchedStep]] = collections.deque()

    @property
    def rank(self) -> int:
        return self.placement.rank

    # ---- device -------------------------------------------------------------------------
    def init_device(self) -> str:
        """Pick the device and start its runtime; returns a description of it."""
        if self.config.device.is_xla:
            self._init_xla_device()
        elif self.config.device.is_jax:
            self._init_jax_device()
        else:
            self._init_torch_device()
        torch.manual_seed(self.config.model.seed)
        return f"{self.device}, rank {self.rank} of {self.placement.world_size}"

    def _init_torch_device(self) -> None:
        """The native path: any torch device, no torch_xla."""
        from tpu_executor.kernels import register_all

        self.device = torch.device(self.config.device.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.config.device.device!r}: torch sees no CUDA GPU here; "
                             "use device='cpu' or 'xla'")
        self._init_cpu_group()
        register_all()

    def _init_jax_device(self) -> None:
        """The JAX path: torchax traces the model, ``jax.jit`` compiles it, over a mesh of
        ``tensor_parallel_size`` devices (this process's, or in a Ray actor, those of every
        host's process together); JAX's persistent cache is used."""
        from tpu_executor.kernels import register_all
        from tpu_executor.worker.jax.runtime import cpu_runtime, join_hosts

        chips = self.config.parallel.tensor_parallel_size
        cpu_runtime()
        if self.config.uses_ray:
            join_hosts(self.placement, chips // self.placement.world_size, on_tpu=tpu_attached())
        self.jax = self._new_jax_runtime(chips)
        with self.jax.context():  # the providers are chosen for the mesh's chips
            registry = register_all()
        self.device = self.jax.device
        if self.config.compile.cache_dir is not None:
            self._use_jax_caches(self.config.compile.cache_dir, registry.fingerprint(jax_path=True))

    def _new_jax_runtime(self, chips: int):
        from tpu_executor.worker.jax.runtime import JaxRuntime

        return JaxRuntime(chips)

    def _use_jax_caches(self, cache_dir: str, kernels_fingerprint: str) -> None:
        """Executables compiled ahead of time for this engine and these chips, when
        ``cache_dir`` holds them; else JAX's persistent cache (``compile_caches.py``)."""
        self.aot_job = use_jax_caches(self.config, self.jax, cache_dir, kernels_fingerprint)

    def device_context(self):
        """Where the worker's torch code runs: torchax's environment on the JAX path."""
        return self.jax.context() if self.jax is not None else contextlib.nullcontext()

    def _init_xla_device(self) -> None:
        os.environ.setdefault("PJRT_DEVICE", "TPU" if tpu_attached() else "CPU")
        on_tpu = os.environ["PJRT_DEVICE"] == "TPU"
        if on_tpu and self.placement.world_size > 1:
            self._init_tpu_multiprocess()
        import torch_xla

        from tpu_executor.kernels import register_all

        registry = register_all()  # after torch_xla is loaded, so it sees whether this is a TPU
        if on_tpu:
            # PJRT's CPU client cannot deserialize executables, so the cache only helps on TPU.
            init_xla_compile_cache(self.config, self.placement, registry.fingerprint())
        else:
            self._init_cpu_group()
        self.device = torch_xla.device()

    def _init_cpu_group(self) -> None:
        """CPU ranks reduce through gloo; they share the host's cores."""
        world = self.placement
        if world.world_size == 1:
            return
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world.local_world_size))
        self.tp = GlooGroup(world, self.config.parallel.collective_timeout_s)

    def _init_tpu_multiprocess(self) -> None:
        """One chip per process: this worker's TPU variables, then PJRT's multiprocess set-up."""
        host_bounds = (1, 1, 1)
        if self.placement.num_nodes > 1:
            from torch_xla._internal import tpu

            # The pod slice's grid of hosts, from the TPU VM's metadata.
            host_bounds = tuple(int(v) for v in tpu.get_tpu_env()["TPU_PROCESS_BOUNDS"].split(","))
        os.environ.update(tpu_topology_env(self.placement, host_bounds))
        from torch_xla._internal import pjrt

        pjrt.initialize_multiprocess(self.placement.local_rank, self.placement.local_world_size)
        self.tp = XlaGroup(self.rank, self.placement.world_size)

    @property
    def on_tpu(self) -> bool:
        return self.device.type == "xla" and os.environ.get("PJRT_DEVICE") == "TPU"

    # ---- model and cache ----------------------------------------------------------------
    def load_model(self) -> int:
        """Load the checkpoint onto the device; returns the model's vocabulary size."""
        model_config, speculative = self.config.model, self.config.speculative
        draft_path = speculative.model if speculative is not None else None  # set for the model methods only
        if draft_path is not None:
            check_draft_checkpoint(model_config.model, draft_path)
        model = load_model(model_config.model, self.dtype, self.tp, model_config.quantization)
        lora = self.config.lora
        if lora.enable_lora:
            enable_lora(model, lora.num_slots, lora.max_lora_rank, self.dtype)
        model = self._placed(model)
        with self.device_context():
            self.model = model
            self.runner = self._new_runner()
        if lora.enable_lora:
            self.adapters = AdapterStore(model, lora.max_lora_rank, lora.max_cpu_loras, self._push_lora)
        if draft_path is not None:
            self.drafter = self._load_drafter(speculative.method, draft_path)
        return self.model.config.vocab_size

    def _push_lora(self, layer: torch.nn.Module) -> None:
        """Replace ``layer``'s adapter buffers by its host slots (one transfer each, no program)."""
        with self.device_context():
            for name in ("lora_a", "lora_b"):
                host = getattr(layer, f"{name}_host")
                layer._buffers[name] = (self.jax.placed_tensor(layer, name, host) if self.jax is not None
                                        else host.to(self.device))
        if self.jax is not None:
            self.runner.jax_graphs.refresh_weights()

    def _load_drafter(self, method: str, path: str) -> PagedDrafter:
        """The runner of the draft checkpoint at ``path``: a draft model, or an EAGLE-3 head
        over the (loaded) target."""
        if method == "eagle3":
            head = self._placed(load_eagle3_head(path, self.model, self.dtype, self.tp))
            return Eagle3Runner(self.config, head, self.model, self.device, runtime=self.jax)
        return DraftModelRunner(self.config, self._placed(load_model(path, self.dtype, self.tp)), self.device,
                                runtime=self.jax)

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (loaded on the host) on the device, in the device's matmul forms; its bytes
        counted in ``weight_bytes``."""
        # CPU-only matmul forms, chosen on the host before the weights move (models/layers/cpu_matmul.py).
        if self.device.type == "cpu":
            pack_for_cpu(model)
        elif self.device.type == "xla" and not self.on_tpu:
            use_xla_cpu_forms(model)
        tensors = itertools.chain(model.parameters(), model.buffers())
        self.weight_bytes += sum(t.numel() * t.element_size() for t in tensors)
        with self.device_context():
            return self.jax.place_model(model) if self.jax is not None else model.to(self.device)

    def _new_runner(self) -> ModelRunner:
        if self.jax is not None:
            return self.runner_class(self.config, self.model, self.device, runtime=self.jax)
        return self.runner_class(self.config, self.model, self.device)

    def cache_block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V), the draft model's block included."""
        bytes_of = self._model_block_bytes
        return bytes_of(self.model) + (bytes_of(self.drafter.model) if self.drafter is not None else 0)

    def cache_kv_heads(self, model: torch.nn.Module) -> int:
        """The KV heads ``model``'s cache holds: its own, or, under JAX SPMD over more chips than
        it has KV heads (a multiple of them), each repeated so that every chip holds the one its
        query heads read. Replicated whole instead, every chip would hold every head, and the
        per-chip Pallas kernels could not take the cache (they would fall back to a reference
        that gathers it)."""
        ranks, heads = (self.jax.ranks if self.jax is not None else 1), model.num_kv_heads
        query_heads = model.config.num_attention_heads
        return ranks if ranks > heads and ranks % heads == 0 and query_heads % ranks == 0 else heads

    def _model_block_bytes(self, model: torch.nn.Module) -> int:
        per_layer = self.cache_kv_heads(model) * self.config.cache.block_size * model.head_dim
        return 2 * model.num_layers * per_layer * torch.tensor([], dtype=self.dtype).element_size()

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: the configured count, else memory left after weights and a
        profiling run (TPU: ``xm.get_memory_info``; GPU: torch's CUDA figures; CPU: the budget)."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        elif self.aot_job is not None:  # the cache's shape is an input of every executable
            num_blocks = self.aot_job.num_blocks
        else:
            num_blocks = int(self._free_cache_bytes() // self.cache_block_bytes())
        needed = self.config.max_blocks_per_seq + 1
        # A default max_model_len is lowered to what the cache holds (EngineCore); one the user
        # set must fit as it is.
        if num_blocks < needed and self.config.model.max_model_len is not None:
            raise ValueError(f"the KV cache holds {num_blocks} blocks but one max_model_len "
                             f"({self.config.max_model_len}) sequence needs {needed}; raise "
                             "memory_budget_bytes / memory_utilization or lower max_model_len")
        return num_blocks

    def _free_cache_bytes(self) -> int:
        """Bytes left for the KV cache's blocks, less what the drafter keeps beside them."""
        reserved = self.drafter.reserved_bytes(self._model_block_bytes(self.drafter.model)) if self.drafter else 0
        return self._free_device_bytes() - reserved

    def _free_device_bytes(self) -> int:
        cache = self.config.cache
        if self.on_tpu:
            import torch_xla.core.xla_model as xm

            self.runner.profile_run(self._allocate_cache(self.config.max_blocks_per_seq + 1))
            info = xm.get_memory_info(self.device)
            return int(info["bytes_limit"] * cache.memory_utilization) - int(info["peak_bytes_used"])
        if self.jax is not None and self.jax.platform != "cpu":
            with self.device_context():
                self.runner.profile_run(self._allocate_cache(self.config.max_blocks_per_seq + 1))
            limit, peak = self.jax.memory_figures()
            return int(limit * cache.memory_utilization) - peak
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.runner.profile_run(self._allocate_cache(self.config.max_blocks_per_seq + 1))
            free, total = torch.cuda.mem_get_info(self.device)
            activations = torch.cuda.max_memory_allocated(self.device) - torch.cuda.memory_allocated(self.device)
            return int(free - total * (1.0 - cache.memory_utilization)) - activations
        return cache.memory_budget_bytes - self.weight_bytes

    def _allocate_cache(self, num_blocks: int, model: Optional[torch.nn.Module] = None
                        ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K/V pages of ``num_blocks`` blocks for ``model`` (the target by default)."""
        model = self.model if model is None else model
        kv_heads = self.cache_kv_heads(model)
        shape = (kv_heads, num_blocks, self.config.cache.block_size, model.head_dim)
        # Split over the heads when they divide evenly over the chips, else replicated.
        heads = 0 if self.jax is not None and kv_heads % self.jax.ranks == 0 else None
        return [(self._zeros(shape, self.dtype, heads), self._zeros(shape, self.dtype, heads))
                for _ in range(model.num_layers)]

    def _zeros(self, shape, dtype: torch.dtype, split: Optional[int] = None) -> torch.Tensor:
        """A zeroed device buffer (on the JAX path split over the mesh along ``split``, else
        replicated)."""
        if self.jax is not None:
            return self.jax.zeros(shape, dtype, split)
        zeros = torch.zeros(shape, dtype=dtype, device=self.device)
        if self.device.type == "xla":
            import torch_xla

            # Materialise the zeros now: a lazy zeros tensor fed to the first compiled step
            # would give that step a different graph than every later one.
            torch_xla.sync()
        return zeros

    def init_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate per-layer K/V tensors (donated buffers) for the model runner, whose bucket
        plan follows ``max_model_len`` (lowered to what the cache holds, if it was a default)."""
        with self.device_context():
            if max_model_len != self.config.max_model_len:
                self.config = dataclasses.replace(self.config, max_model_len=max_model_len)
                self.runner = self._new_runner()
            self.runner.bind_kv_caches(self._allocate_cache(num_blocks))
            if self.drafter is not None:
                draft_blocks = num_blocks + self.drafter.num_scratch_blocks
                self.drafter.bind(self.runner, self._allocate_cache(draft_blocks, self.drafter.model), num_blocks,
                                  self._zeros)
        self.kv_cache_bytes = num_blocks * self.cache_block_bytes()

    def warmup(self, show_progress: bool = True, graphs: Optional[List[Graph]] = None) -> None:
        """Compile every graph of the bucket plan, or ``graphs`` of it; on the native path,
        where nothing compiles, run one padding step to note the kernels' providers."""
        with self.device_context():
            if self.config.device.compiles:
                self.runner.warmup(show_progress and self.rank == 0, graphs, drafter=self.drafter)
            else:
                self.runner.note_kernels()

    def time_graphs(self, graphs: List[Graph], repeats: int) -> List[float]:
        """Median seconds of each graph on padding-only inputs (the cost model's check)."""
        with self.device_context():
            return [self.runner.time_graph(graph, repeats) for graph in graphs]

    # ---- serving ------------------------------------------------------------------------
    def start_step(self, step: SchedulerOutput) -> LaunchedStep:
        """Hand one step to the device; its exceptions propagate. An adapter of
        ``step.lora_loads`` that cannot be written leaves its slot empty and the step runs:
        the output names it (``lora_failures``), and the engine discards its requests' tokens."""
        if step.lora_reads:
            self.adapters.read_ahead(step.lora_reads)
        failures = []
        if step.lora_loads:  # host work: outside the device's context (torchax would take the host tensors)
            failures = self.adapters.write(step.lora_loads)
        capture = self.drafter.capture() if self.drafter is not None else contextlib.nullcontext()
        with self.device_context(), capture:
            launched = self.runner.launch(step)
        return WithLoRAFailures(launched, tuple(failures)) if failures else launched

    def launch_step(self, step: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """Start one step. Returns its output when there is one already: on eager devices (the
        tokens are on the host once the step ran) or when it failed to start. Returns None when
        its tokens are still on the device (XLA): ``collect_step`` reads them, after the next
        step has been launched if the engine schedules ahead. An exception fails the step
        (reported in the output), not the worker."""
        try:
            launched = self.start_step(step)
            if not self.runner.collects_late:
                return self._drafted(step, launched.collect())
        except Exception as err:  # noqa: BLE001 - the engine fails this step's requests
            return self._failed(err)
        self._launched.append((step, launched))
        return None

    def collect_step(self) -> ModelRunnerOutput:
        """The tokens of the oldest step ``launch_step`` left on the device (waits for it)."""
        step, launched = self._launched.popleft()
        try:
            with self.device_context():
                output = launched.collect()
            return self._drafted(step, output)
        except Exception as err:  # noqa: BLE001 - a device error fails this step's requests
            return self._failed(err)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step to the end: launch it and collect its tokens."""
        output = self.launch_step(step)
        return output if output is not None else self.collect_step()

    def _drafted(self, step: SchedulerOutput, output: ModelRunnerOutput) -> ModelRunnerOutput:
        """``output`` with the drafter's drafts for the next step (none without one, or when the
        step failed). A drafter that fails costs the step its drafts, not its tokens: its
        requests decode without drafts in the next step (the target verifies whatever comes
        later, so its outputs stay the target's), and ``draft_error`` says why; the executor
        holds the ranks to failing alike (``executor.base.agree_on_step``)."""
        if self.drafter is None or output.error is not None:
            return output
        try:
            with self.device_context():
                return dataclasses.replace(output, drafts=self.drafter.draft(step, output.sampled))
        except Exception as err:  # noqa: BLE001 - the step's tokens stand without drafts
            message = f"the {self.drafter.kind} failed: {type(err).__name__}: {err}"
            logger.warning("rank %d: %s; the step's tokens stand, its %d drafting requests decode without drafts",
                           self.rank, message, len(step.drafting), exc_info=True)
            return dataclasses.replace(output, draft_error=message)

    def _failed(self, err: Exception) -> ModelRunnerOutput:
        logger.exception("rank %d: step failed", self.rank)
        return ModelRunnerOutput(error=f"{type(err).__name__}: {err}")

    def stats(self) -> WorkerStats:
        guard = self.runner.guard
        hits, misses, seconds = guard.warmup_cache_figures
        drafter = [self.drafter.jax_graphs] if self.drafter is not None else []
        # Executables compiled ahead of time, loaded (the target's and the drafter's).
        hits += sum(graphs.loaded for graphs in [self.runner.jax_graphs] + drafter if graphs is not None)
        return WorkerStats(guard.compiled_during_warmup, guard.compiled_after_warmup,
                           self.runner.padding, self.kv_cache_bytes, hits, misses, seconds,
                           self.runner.kernel_providers)

    def close(self) -> None:
        """Leave the tensor-parallel group."""
        self.tp.close()

