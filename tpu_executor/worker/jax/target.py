"""The JAX path compiled for a TPU slice this machine does not have.

libtpu's compiler runs on a CPU-only machine: ``get_topology_desc`` gives compile-only devices
of any slice, and ``jax.jit(f).lower(shapes with shardings).compile()`` compiles for them.
``TargetWorker`` is the worker of such a slice: the model is built from the checkpoint's config
alone (every parameter and buffer a shape on the slice's mesh, never a constant), the KV cache
likewise, and the model runner's warm-up traces every graph of the bucket plan as it would on
the slice, with the kernel providers the slice's chips select (the Pallas kernels), and hands
each to libtpu. Nothing runs: each call answers with the shapes of its outputs.
"""
from __future__ import annotations

import itertools
import logging
import os
from typing import FrozenSet, List, NamedTuple, Optional, Sequence

import torch

from tpu_executor.core.buckets import Graph
from tpu_executor.core.config import EngineConfig
from tpu_executor.core.tpu_slices import Target
from tpu_executor.worker.draft_model import DraftModelRunner
from tpu_executor.worker.eagle3 import Eagle3Runner
from tpu_executor.worker.jax.aot import AotJob
from tpu_executor.worker.jax.runtime import JaxRuntime, bytes_per_chip, cpu_runtime
from tpu_executor.worker.paged_drafter import PagedDrafter
from tpu_executor.worker.worker import Worker

logger = logging.getLogger(__name__)


def target_devices(target: Target) -> List:
    """The compile-only devices of every chip of ``target`` (all its hosts', from this process)."""
    from jax.experimental import topologies

    cpu_runtime(even_with_tpus=True)  # the compile-only devices need no TPU runtime
    # Compiling uses no chip, so another process holding libtpu's lockfile (a torch_xla or JAX
    # process on this machine: both load libtpu when it is installed) must not stop it. libtpu
    # reads this when it loads, here.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=target.topology_name, chip_config_name=target.chip_config_name,
            chips_per_host_bounds=target.chips_per_host_bounds, num_slices=1)
    except Exception as err:  # noqa: BLE001 - libtpu missing or refusing the topology
        raise ValueError(f"cannot describe {target.name} ({target.topology_name}) for the TPU compiler: {err}; "
                         "the compiler is libtpu: pip install 'tpu_executor[tpu]'") from err
    return list(topology.devices)


def model_bytes_per_chip(model: torch.nn.Module) -> int:
    """Bytes of one chip's share of ``model``'s parameters and buffers, as placed."""
    return sum(bytes_per_chip(t.jax()) for t in itertools.chain(model.parameters(), model.buffers()))


class Resident(NamedTuple):
    """Bytes per chip that stay in HBM while the engine serves: ``weights`` (every model's),
    ``state`` (the device buffers kept between steps: KV caches, the sampler's and the
    drafter's state), and the ids of the state's tensors (``CompileRecord.inputs`` names a
    call's arguments by them)."""

    weights: int
    state: int
    state_ids: FrozenSet[int]

    @property
    def bytes(self) -> int:
        return self.weights + self.state


class TargetRuntime(JaxRuntime):
    """A ``JaxRuntime`` over compile-only devices: arrays are shapes with placements."""

    abstract = True

    def place(self, array, sharding):
        import jax

        return jax.ShapeDtypeStruct(tuple(array.shape), array.dtype, sharding=sharding)

    def place_tensor(self, tensor: torch.Tensor, sharding):
        import jax
        from torchax.ops.mappings import t2j_dtype

        return self.place(jax.ShapeDtypeStruct(tuple(tensor.shape), t2j_dtype(tensor.dtype)), sharding)

    def zeros(self, shape, dtype: torch.dtype, split=None):
        """Zeros' shape and placement only (a slice's KV cache may be larger than this host)."""
        import jax
        from torchax.ops.mappings import t2j_dtype
        from torchax.tensor import Tensor as JaxTensor

        shaped = jax.ShapeDtypeStruct(tuple(shape), t2j_dtype(dtype))
        return JaxTensor(self.place(shaped, self.sharding(shape, split)), self.env)

    def memory_figures(self):
        raise ValueError("compile-only devices have no memory figures: the compile sizes the KV cache")


class TargetWorker(Worker):
    """The worker of a slice compiled for here; ``devices`` are its compile-only devices."""

    def __init__(self, config: EngineConfig, devices: Sequence):
        super().__init__(config)
        self.target_devices = list(devices)

    def _new_jax_runtime(self, chips: int) -> JaxRuntime:
        return TargetRuntime(chips, self.target_devices)

    def _use_jax_caches(self, cache_dir: str, kernels_fingerprint: str) -> None:
        """Nothing is loaded: a compile for a slice compiles every graph (``keep_in``)."""

    def keep_in(self, job: AotJob) -> None:
        """Write the programs traced and the executables compiled from here on into ``job``
        (the runner's and the drafter's: their functions read the runtime's stores)."""
        job.attach(self.jax, writes=True)
        if self.runner is not None:  # a fresh runner: one whose probes compiled a graph would not compile it again
            with self.device_context():
                self.runner = self._new_runner()

    def load_model(self) -> int:
        """The model's shapes on the slice's mesh (no weights are read)."""
        from tpu_executor.worker.model_loader import build_model_shapes

        model = build_model_shapes(self.config.model.model, self.dtype, self.config.model.quantization)
        with self.device_context():
            self.model = self.jax.place_model(model)
            self.runner = self._new_runner()
        speculative = self.config.speculative
        if speculative is not None and speculative.model is not None:
            with self.device_context():
                self.drafter = self._drafter_shapes(speculative.method, speculative.model)
        self.weight_bytes = self.weight_bytes_per_chip()
        return self.model.config.vocab_size

    def _drafter_shapes(self, method: str, path: str) -> PagedDrafter:
        """The runner of the draft model's or EAGLE-3 head's shapes on the slice's mesh."""
        from tpu_executor.worker.model_loader import build_eagle3_head_shapes, build_model_shapes

        if method == "eagle3":
            head = self.jax.place_model(build_eagle3_head_shapes(path, self.model, self.dtype))
            return Eagle3Runner(self.config, head, self.model, self.device, runtime=self.jax)
        draft = build_model_shapes(path, self.dtype, self.config.model.quantization)
        return DraftModelRunner(self.config, self.jax.place_model(draft), self.device, runtime=self.jax)

    def weight_bytes_per_chip(self) -> int:
        """Bytes of one chip's share of every parameter and buffer (the draft model's or EAGLE-3
        head's too), as placed."""
        drafter = [self.drafter.model] if self.drafter is not None else []
        return sum(model_bytes_per_chip(model) for model in [self.model] + drafter)

    def draft_weight_bytes_per_chip(self) -> int:
        """The draft model's or EAGLE-3 head's share of ``weight_bytes_per_chip``."""
        return model_bytes_per_chip(self.drafter.model) if self.drafter is not None else 0

    def resident(self) -> Resident:
        """What stays in each chip's HBM beside every graph of the cache ``init_cache`` made:
        the weights, the KV cache, the sampler's logits-processing state, and the drafter's
        KV cache (its scratch blocks too) and buffers."""
        sampling = self.runner.sampling
        state = [t for layer in self.runner.kv_caches for t in layer] + list(sampling.processing.state)
        if self.drafter is not None:
            state += self.drafter.device_state()
        unique = {id(t): t for t in state}  # an EAGLE-3 head's tap buffers are the runner's too
        return Resident(self.weight_bytes, sum(bytes_per_chip(t.jax()) for t in unique.values()),
                        frozenset(unique))

    def cache_block_bytes_per_chip(self) -> int:
        """One KV block's bytes on one chip: the cache is split over its heads when they divide
        over the chips, else every chip holds all of it."""
        ranks = self.config.parallel.tensor_parallel_size
        split = ranks if self.cache_kv_heads(self.model) % ranks == 0 else 1
        return self.cache_block_bytes() // split

    def compile_plan(self, num_blocks: int, max_model_len: int, show_progress: bool = True,
                     graphs: Optional[List[Graph]] = None) -> List:
        """Compile every graph of the plan (or ``graphs``) over a KV cache of ``num_blocks``
        blocks, serving ``max_model_len`` tokens; returns the compile records
        (``graphs.CompileRecord``), model steps first."""
        self.init_cache(num_blocks, max_model_len)
        # A runner kept for another cache holds earlier ones.
        sources = [self.runner.jax_graphs] + ([self.drafter.jax_graphs] if self.drafter is not None else [])
        done = [len(graphs.records) for graphs in sources]
        self.warmup(show_progress, graphs)
        return [record for graphs, start in zip(sources, done) for record in graphs.records[start:]]
