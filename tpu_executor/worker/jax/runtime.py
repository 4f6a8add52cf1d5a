"""The JAX path's device side: torchax's environment, the device mesh, where weights, caches
and inputs live, and the persistent compile cache.

Tensor parallelism here is SPMD inside one process: the model is built whole (one rank), its
weights are placed over a ``("tp",)`` mesh with Megatron's shardings (column-parallel layers
split their output features, row-parallel layers their input features, the embedding and the
LM head the vocabulary, experts their intermediate features), the KV cache over its heads when
they divide evenly (else replicated), and XLA's partitioner inserts the collectives.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

# (layer class name, parameter name) -> the dimension split over the mesh. Weights are stored
# [in, out]; the embedding and LM head [vocab, hidden]; experts [E, H, 2I] and [E, I, H].
SPLIT_DIMS = {
    ("ColumnParallelLinear", "weight"): 1, ("ColumnParallelLinear", "bias"): 0,
    ("MergedColumnParallelLinear", "weight"): 1, ("MergedColumnParallelLinear", "bias"): 0,
    ("QKVParallelLinear", "weight"): 1, ("QKVParallelLinear", "bias"): 0,
    ("RowParallelLinear", "weight"): 0,
    ("VocabParallelEmbedding", "weight"): 0, ("ParallelLMHead", "weight"): 0,
    ("ExpertWeights", "w13"): 2, ("ExpertWeights", "w2"): 1,
    # LoRA slots split as their layer: B by output features, A by input features.
    ("ColumnParallelLinear", "lora_b"): 2, ("MergedColumnParallelLinear", "lora_b"): 2,
    ("QKVParallelLinear", "lora_b"): 2, ("RowParallelLinear", "lora_a"): 1,
}
# Quantized levels, by the dimension counted from the end: the column-parallel family's output
# features; a row-parallel layer's input features for INT8, its output features for packed INT4
# (a byte holds inputs i and i + k/2, so an input split would regroup the unpacked weight);
# experts as their unquantized weights. Scales and zeros follow their levels (``split_dim``).
_COLUMNS = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear")
QUANTIZED_SPLIT_DIMS = {
    **{(layer, name): -1 for layer in _COLUMNS for name in ("weight_q", "weight_q4")},
    ("RowParallelLinear", "weight_q"): -2, ("RowParallelLinear", "weight_q4"): -1,
    ("ExpertWeights", "w13_q"): -1, ("ExpertWeights", "w13_q4"): -1,
    ("ExpertWeights", "w2_q"): -2, ("ExpertWeights", "w2_q4"): -1,
}
LIBRARIES = ("jax", "jaxlib", "torch", "torchax")


def split_dim(module: torch.nn.Module, name: str, shape: Tuple[int, ...], ranks: int) -> Optional[int]:
    """The dimension of ``module.<name>`` split over ``ranks`` chips, or None (replicated):
    layers Megatron does not split (norms, the router), and sizes that do not divide evenly."""
    dim = SPLIT_DIMS.get((type(module).__name__, name))
    if name.endswith(("_q", "_q4", "_scale", "_zero")):
        dim = _quantized_split(module, name, len(shape))
    if ranks == 1 or dim is None or shape[dim] % ranks:
        return None
    return dim


def _quantized_split(module: torch.nn.Module, name: str, rank: int) -> Optional[int]:
    """The split dimension of a quantized layer's levels, scales or zeros (None: replicated):
    scales and zeros split as their levels, except per-channel scales of levels split by input."""
    base = name.rsplit("_", 1)[0]
    levels = next((f"{base}{s}" for s in ("_q", "_q4") if f"{base}{s}" in module._parameters), None)
    from_end = QUANTIZED_SPLIT_DIMS.get((type(module).__name__, levels))
    if from_end is None or (from_end == -2 and rank < module._parameters[levels].dim()):
        return None
    return rank + from_end


def bytes_per_chip(array) -> int:
    """Bytes of one chip's share of ``array`` (a JAX array, or a shape with its sharding)."""
    shard = array.sharding.shard_shape(tuple(array.shape))
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(array.dtype).itemsize


def compiler_flags(value: str) -> str:
    """``XLA_FLAGS`` as they steer the compiler: without the ``--xla_dump_*`` options, which
    only write what it did beside (reading a compile's graphs must not miss its executables)."""
    return " ".join(flag for flag in value.split() if not flag.startswith("--xla_dump"))


def target_parts(platform: str, device_kind: str, devices: int, partitioner: str) -> Dict[str, str]:
    """What executables depend on besides their program: the platform, the chips (kind and
    count), the partitioner, the compiler's flags (``XLA_FLAGS``), and on a TPU the compiler
    itself (libtpu's version and its flags, ``LIBTPU_INIT_ARGS``)."""
    described = {"platform": platform, "device_kind": device_kind, "devices": str(devices),
                 "partitioner": partitioner, "xla_flags": compiler_flags(os.environ.get("XLA_FLAGS", ""))}
    if platform == "tpu":
        described.update(libtpu=libtpu_version(), libtpu_init_args=os.environ.get("LIBTPU_INIT_ARGS", ""))
    return described


def cpu_runtime(even_with_tpus: bool = False) -> None:
    """Keep JAX's runtime on the CPU on a machine without TPU chips (``even_with_tpus``: on any;
    compile-only devices need no TPU runtime). With libtpu installed, JAX would first try to
    start a TPU: it logs errors, falls back to the CPU, and keeps libtpu's lockfile for the life
    of the process, so that no other process here could load libtpu (a compile for a TPU slice
    among them). Does nothing once JAX has started its backends."""
    import jax
    from jax._src import xla_bridge

    from tpu_executor.core.config import tpu_attached

    if (even_with_tpus or not tpu_attached()) and not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")


def libtpu_version() -> str:
    """The installed libtpu's version ("none" without it): an executable runs only under the
    libtpu that compiled it."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def join_hosts(placement, local_chips: int, on_tpu: bool) -> None:
    """Make this process one host of a multi-host JAX mesh (before JAX starts its backend):
    process ``placement.rank`` of ``placement.world_size``, meeting the others at rank 0's
    address. Without a TPU a host's chips are ``local_chips`` virtual CPU devices and the
    collectives between processes go through gloo, so a cluster is simulated on one machine."""
    import jax

    if not on_tpu:
        jax.config.update("jax_num_cpu_devices", local_chips)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if placement.world_size > 1:
        jax.distributed.initialize(coordinator_address=f"{placement.master_addr}:{placement.master_port}",
                                   num_processes=placement.world_size, process_id=placement.rank)


def to_mesh(array, sharding):
    """``array`` (host or device) placed as ``sharding`` says. A sharding over several hosts
    is filled by each process with its own chips' parts of the same host value: ``device_put``
    would first check that the processes agree, with a collective (and a compile) per call."""
    import jax

    if sharding.is_fully_addressable:
        return jax.device_put(array, sharding)
    host = np.asarray(array)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


@functools.lru_cache(maxsize=None)  # the package's files: read once a process
def source_fingerprint() -> str:
    """Hash of every Python file of tpu_executor, its models and its kernels: the traced
    programs come from this code."""
    digest = hashlib.sha256()
    for package in ("tpu_executor", "tpu_executor.models", "tpu_executor.kernels"):
        root = os.path.dirname(importlib.util.find_spec(package).origin)
        for folder, _, names in sorted(os.walk(root)):
            for name in sorted(n for n in names if n.endswith(".py")):
                with open(os.path.join(folder, name), "rb") as source:
                    digest.update(source.read())
    return digest.hexdigest()


class JaxRuntime:
    """One process's JAX devices for one engine: ``tensor_parallel_size`` of them in a mesh
    (``devices``: these, not the process's own)."""

    abstract = False  # arrays hold shapes and placements only (compiling for another machine)

    def __init__(self, tensor_parallel_size: int, devices: Optional[Sequence] = None):
        import jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from tpu_executor.kernels.binding import torchax_env
        from tpu_executor.worker.jax.programs import ExecutableStore, ProgramStore

        devices = list(devices) if devices is not None else jax.devices()
        if len(devices) < tensor_parallel_size:
            hint = (" (on a CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count="
                    f"{tensor_parallel_size})" if devices[0].platform == "cpu" else "")
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} JAX devices, "
                             f"this process sees {len(devices)}{hint}")
        self.env = torchax_env()
        self.mesh = Mesh(np.array(devices[:tensor_parallel_size]), ("tp",))
        self.ranks = tensor_parallel_size
        self.platform = devices[0].platform
        self.device = torch.device("jax")
        self._spec, self._named = PartitionSpec, NamedSharding
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.programs = ProgramStore(None)  # traced programs: kept once a compile cache is set
        self.executables = ExecutableStore(None)  # compiled ahead of time (``tpu-executor compile``)

    def place(self, array, sharding):
        """``array`` (host or device) on the mesh as ``sharding`` says."""
        return to_mesh(array, sharding)

    def place_tensor(self, tensor: torch.Tensor, sharding):
        """A CPU torch tensor (a weight, a buffer) on the mesh as ``sharding`` says."""
        from tpu_executor.kernels.binding import torch_to_host

        return self.place(torch_to_host(tensor.detach()), sharding)

    @property
    def target(self) -> Dict[str, str]:
        """What the executables compiled for these devices depend on besides the program
        (``target_parts``); the partitioner is always Shardy (``graphs.use_shardy``)."""
        return target_parts(self.platform, self.mesh.devices.flat[0].device_kind, self.mesh.size, "shardy")

    @contextlib.contextmanager
    def context(self):
        """Where the JAX path's torch code runs: torchax's environment, with 64-bit integers on
        (the sampler hashes 64-bit seeds; token ids are int64 as on every path). Both are
        scoped, not process-wide: the torch_xla path in the same process keeps JAX's defaults."""
        import jax

        from tpu_executor.kernels.binding import torchax_env

        torchax_env()  # this thread's share of torchax's state
        # The mesh rides on torchax's runtime properties: kernel providers read it (binding.py).
        with jax.enable_x64(True), self.env, self.env.override_property(mesh=self.mesh):
            yield

    def sharding(self, shape: Tuple[int, ...], dim: Optional[int]):
        """Split ``dim`` of an array of ``shape`` over the mesh (None: replicated)."""
        if dim is None:
            return self.replicated
        spec = [None] * len(shape)
        spec[dim] = "tp"
        return self._named(self.mesh, self._spec(*spec))

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move every parameter and buffer onto the mesh, split as ``split_dim`` says."""
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    placed = self.placed_tensor(module, name, tensor)
                    table[name] = torch.nn.Parameter(placed, requires_grad=False) \
                        if isinstance(tensor, torch.nn.Parameter) else placed
        return model

    def placed_tensor(self, module: torch.nn.Module, name: str, tensor: torch.Tensor):
        """``module``'s host tensor ``name`` on the mesh, split as ``place_model`` splits it."""
        from torchax.tensor import Tensor as JaxTensor

        where = self.sharding(tuple(tensor.shape), split_dim(module, name, tuple(tensor.shape), self.ranks))
        return JaxTensor(self.place_tensor(tensor, where), self.env)

    def zeros(self, shape: Tuple[int, ...], dtype: torch.dtype, split: Optional[int] = None):
        """A torchax tensor of zeros on the mesh (``split``: the dimension split over it)."""
        from torchax.ops.mappings import t2j_dtype
        from torchax.tensor import Tensor as JaxTensor

        # Host zeros moved over: an eager jnp.zeros would compile a program of its own.
        array = self.place(np.zeros(shape, t2j_dtype(dtype)), self.sharding(shape, split))
        return JaxTensor(array, self.env)

    def put(self, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Host tensors of one call onto every chip of the mesh, in one transfer."""
        import jax
        from torchax.tensor import Tensor as JaxTensor

        from tpu_executor.kernels.binding import torch_to_host

        hosts = [torch_to_host(t) for t in tensors.values()]
        if self.replicated.is_fully_addressable and not self.abstract:
            arrays = jax.device_put(hosts, self.replicated)
        else:
            arrays = [self.place(host, self.replicated) for host in hosts]
        return {name: JaxTensor(array, self.env) for name, array in zip(tensors, arrays)}

    def memory_figures(self) -> Tuple[int, int]:
        """(bytes this process's first chip can hold, its peak bytes in use so far)."""
        import jax

        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            raise ValueError(f"the {self.platform} runtime reports no memory figures: set num_blocks")
        return int(stats["bytes_limit"]), int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))

    def use_compile_cache(self, root: str, key: str) -> str:
        """Point JAX's persistent cache at ``root/key`` (every compiled graph is kept, however
        fast it compiled), and keep traced programs in its ``programs/``. JAX's cache is
        process-wide: the engine started last in a process decides where it lies."""
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        from tpu_executor.worker.jax.programs import ProgramStore

        path = os.path.join(root, key)
        self.programs = ProgramStore(os.path.join(path, "programs"))
        os.makedirs(path, exist_ok=True)
        if jax.config.jax_compilation_cache_dir != path:
            compilation_cache.reset_cache()
            jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        return path
