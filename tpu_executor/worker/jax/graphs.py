"""Compiled graphs on the JAX path: the runner's torch step functions, traced by torchax and
compiled with ``jax.jit``, one executable per bucket.

A ``JaxFunction`` takes the same keyword arguments as the torch function it wraps. Tensor
arguments (torchax tensors) are the executable's inputs; every other argument (ints, bools,
None) is static and part of the executable's key, like the bucket's shapes. The model's
weights are inputs too, never constants baked into the program. An input the function
updates in place (the KV cache, the logits-processing state) comes back as an output and is
donated, so XLA writes it where it lies instead of copying it each step; after the call the
caller's tensor holds the new buffer, as after an in-place torch op. Every other output is
replicated over the mesh, so the next graph that takes it finds the placement it was compiled
for (logits are gathered, as Megatron's LM head does).

Executables are built in two moves: ``lower`` (tracing the torch code, or reading the traced
program back from the ``ProgramStore``: Python, one at a time) and ``compile`` (XLA, which
releases the GIL, so a thread pool compiles several at once; JAX's persistent cache answers
when the same program was compiled before).
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import numpy as np
import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torchax import interop
from torchax.tensor import Tensor as JaxTensor

from tpu_executor.kernels.registry import REGISTRY
from tpu_executor.worker.jax.programs import KernelChoice, OutputStructure, TracedProgram, program_key
from tpu_executor.worker.jax.runtime import bytes_per_chip


class CallSignature(NamedTuple):
    """What picks an executable: the arguments' structure, static values, shapes and dtypes."""

    treedef: Any
    static: Tuple
    shapes: Tuple


class _Call(NamedTuple):
    signature: CallSignature
    leaves: List[Any]
    tensor_positions: Tuple[int, ...]

    def arrays(self) -> List[Any]:
        return [self.leaves[i].jax() for i in self.tensor_positions]


class Pending(NamedTuple):
    """A lowered program waiting for XLA (``JaxFunction.compile`` finishes it); ``label``
    names the graph of the plan it was lowered for; ``inputs`` its tensor arguments' bytes
    (``CompileRecord.inputs``)."""

    signature: CallSignature
    lowered: Any
    program: TracedProgram
    key: str
    label: str
    inputs: Tuple[Tuple[int, int], ...]


class GraphCompileError(RuntimeError):
    """XLA (or libtpu) refused a graph; the message names it, and ``label`` is its name."""

    def __init__(self, message: str, label: str = ""):
        super().__init__(message)
        self.label = label


class CompileRecord(NamedTuple):
    """One executable compiled at warm-up: the graph it serves, its function, how long XLA
    took, the executable (its memory and cost analyses), and ``inputs``: per tensor argument
    but the weights, ``(id of the torch tensor passed, its bytes on one chip)``, so that a
    caller that knows which tensors stay on the device (a KV cache) can tell them from the
    call's own inputs."""

    label: str
    function: str
    key: str
    seconds: float
    compiled: Any
    program: TracedProgram
    inputs: Tuple[Tuple[int, int], ...] = ()


def _split(kwargs: Dict[str, Any]) -> _Call:
    # Keyword order is no part of a call's meaning, but it is of a dict's tree structure.
    leaves, treedef = pytree.tree_flatten(dict(sorted(kwargs.items())))
    positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    for i in positions:
        if not isinstance(leaves[i], JaxTensor):
            raise TypeError(f"argument tensor on {leaves[i].device}: the JAX path takes tensors on the 'jax' device")
    static = tuple(None if i in positions else leaves[i] for i in range(len(leaves)))
    shapes = tuple((tuple(leaves[i].shape), leaves[i].dtype) for i in positions)
    return _Call(CallSignature(treedef, static, shapes), leaves, positions)


def use_shardy() -> None:
    """Partition with Shardy, which the JAX path's programs are exported and compiled for (under
    GSPMD StableHLO's verifier rejects an exported call's shardings). Set before each export,
    lowering and compile, process-wide (a compile runs on a pool thread): torch_xla's
    ``call_jax`` turns it off process-wide for its own XLA, which expects GSPMD shardings."""
    jax.config.update("jax_use_shardy_partitioner", True)


def _split_donated(arrays: Sequence[Any], donated: Sequence[int]) -> Tuple[List[Any], List[Any]]:
    return [a for k, a in enumerate(arrays) if k not in donated], [arrays[k] for k in donated]


def _exported_shardings(donated: Sequence[Any]) -> Tuple[None, List[Any]]:
    """The shardings an exported program pins on its outputs: only those of state split over
    the mesh (a KV cache over its heads); the call that lowers it places every output.

    Why: libtpu 0.0.42.1 aborts compiling an SPMD program whose exported call returns a 64-bit
    integer with a sharding pinned (its 64-bit rewrite splits the value that Shardy's
    ``FuncResultSharding`` marks in two), as the sampler's token ids and seeds are."""
    return None, [None if a.sharding.is_fully_replicated else a.sharding for a in donated]


class JaxGraphs:
    """The compiled functions of one model runner: the weights they read, the torchax
    environment they trace in, where traced programs are kept, and the mesh placement of
    their outputs."""

    def __init__(self, model: torch.nn.Module, runtime):
        self.model = model
        self.env = runtime.env
        self.replicated = runtime.replicated
        self.place = runtime.place  # host arrays onto the mesh (shapes only, compiling for another machine)
        self.platform = runtime.platform
        self.runtime = runtime  # its program and executable stores: those of the job or cache set last
        self.lock = threading.Lock()
        self._weights: Optional[Dict[str, Any]] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self.compiling: List[Future] = []
        self.label = ""  # the plan's graph being warmed up (names what compiles)
        self.records: List[CompileRecord] = []
        self.functions: List["JaxFunction"] = []
        self.loaded = 0  # executables loaded from the ahead-of-time store

    @property
    def store(self):
        """Where traced programs are kept (``programs.ProgramStore``)."""
        return self.runtime.programs

    @property
    def executables(self):
        """Where executables compiled ahead of time are kept (``programs.ExecutableStore``)."""
        return self.runtime.executables

    @contextlib.contextmanager
    def ahead_of_time(self, threads: int):
        """Within this block a call that finds no executable lowers its program, hands the
        compilation to a pool of ``threads`` and returns zeros of its outputs' shapes (the
        inputs it would update are left as they were); ``compiling`` holds the futures."""
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="jax-compile") as pool:
            self._pool, self.compiling = pool, []
            try:
                yield self.compiling
            finally:
                self._pool = None

    def weights(self) -> Dict[str, Any]:
        """The model's parameters and buffers as JAX arrays (inputs of every executable)."""
        if self._weights is None:
            named = dict(self.model.named_parameters(remove_duplicate=False))
            named.update(self.model.named_buffers(remove_duplicate=False))
            self._weights = {name: tensor.jax() for name, tensor in named.items()}
        return self._weights

    def refresh_weights(self) -> None:
        """Read the model's arrays again at the next call (a buffer was replaced: new adapters)."""
        self._weights = None

    @property
    def compiling_ahead(self) -> bool:
        """Inside ``ahead_of_time``: calls answer with zeros, nothing runs."""
        return self._pool is not None

    def function(self, fn: Callable) -> "JaxFunction":
        function = JaxFunction(fn, self)
        self.functions.append(function)
        return function

    def kernel_choices(self) -> List[KernelChoice]:
        """The kernel providers held by every program compiled or loaded so far."""
        return [choice for function in self.functions for _, program in function.executables.values()
                for choice in program.kernels]


class JaxFunction:
    """``fn`` (a torch function of keyword arguments) compiled per call signature."""

    def __init__(self, fn: Callable, graphs: JaxGraphs):
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or fn.func.__qualname__  # a method, or a partial
        self.graphs = graphs
        self.executables: Dict[CallSignature, Tuple[Any, TracedProgram]] = {}
        self._mutated: Dict[Tuple, Tuple[int, ...]] = {}  # (treedef, static) -> updated inputs
        self._ahead: Dict[CallSignature, Any] = {}  # outputs' shapes, while compiling ahead

    def __call__(self, **kwargs):
        call = _split(kwargs)
        entry = self.executables.get(call.signature) or self._load(call)
        if entry is None and self.graphs.compiling_ahead:
            return self._compile_ahead(call)
        if entry is None:
            self.compile(self._lower(call))
            entry = self.executables[call.signature]
        executable, program = entry
        kept, donated = _split_donated(call.arrays(), program.donated)
        outputs, updated = executable(self.graphs.weights(), kept, donated)
        for k, array in zip(program.donated, updated):
            call.leaves[call.tensor_positions[k]]._elem = array
        return program.outputs.rebuild([JaxTensor(a, self.graphs.env) for a in outputs])

    def compile(self, pending: Optional[Pending]) -> None:
        """Compile a lowered program (XLA's work: safe on a worker thread); at warm-up the
        executable is recorded, and kept in the executable store when it takes new ones."""
        if pending is None:
            return
        start = time.perf_counter()
        use_shardy()
        try:
            compiled = pending.lowered.compile()
        except Exception as err:  # noqa: BLE001 - named by its graph, raised as the compiler's error
            raise GraphCompileError(f"compiling {pending.label or self.name} failed: {type(err).__name__}: "
                                    f"{str(err)[:2000]}", pending.label or self.name) from err
        seconds = time.perf_counter() - start
        self.executables[pending.signature] = (compiled, pending.program)
        if self.graphs.compiling_ahead:
            self.graphs.records.append(CompileRecord(pending.label, self.name, pending.key, seconds, compiled,
                                                     pending.program, pending.inputs))
        if self.graphs.executables.writes:
            self.graphs.executables.save(pending.key, compiled)

    def _load(self, call: _Call) -> Optional[Tuple[Any, TracedProgram]]:
        """The executable compiled ahead of time for this call, with its traced program, when
        the executable store holds both (None otherwise: it is compiled here)."""
        store = self.graphs.executables
        if store.directory is None or store.writes:  # nothing kept, or compiling them now
            return None
        key = program_key(self.name, call.signature)
        program = self.graphs.store.load(key)
        executable = store.load(key) if program is not None else None
        if executable is None:
            return None
        self._onto_mesh(call)
        self.executables[call.signature] = (executable, program)
        self.graphs.loaded += 1
        return self.executables[call.signature]

    def _compile_ahead(self, call: _Call):
        """Lower now, compile on the pool, answer with zeros shaped like the outputs."""
        if call.signature not in self._ahead:
            pending = self._lower(call)
            self._ahead[call.signature] = (pending.lowered.out_info[0], pending.program.outputs)
            self.graphs.compiling.append(self.graphs._pool.submit(self.compile, pending))
        shapes, outputs = self._ahead[call.signature]
        # Host zeros moved over: an eager jnp.zeros would compile a program of its own.
        zeros = [self.graphs.place(np.zeros(info.shape, info.dtype), self.graphs.replicated) for info in shapes]
        return outputs.rebuild([JaxTensor(a, self.graphs.env) for a in zeros])

    def _lower(self, call: _Call) -> Pending:
        """The call's program, read back or traced (and kept), lowered for its inputs."""
        use_shardy()
        self._onto_mesh(call)
        key = program_key(self.name, call.signature)
        program = self.graphs.store.load(key)
        if program is None:
            program = self._trace(call)
            self.graphs.store.save(key, program)
        arrays = call.arrays()
        kept, donated = _split_donated(arrays, program.donated)
        # State updated in place stays where it was placed (a KV cache split over its heads).
        out_shardings = (self.graphs.replicated, [a.sharding for a in donated])
        jitted = jax.jit(program.exported.call, donate_argnums=(2,), out_shardings=out_shardings)
        lowered = jitted.trace(self.graphs.weights(), kept, donated).lower()
        inputs = tuple((id(call.leaves[i]), bytes_per_chip(a)) for i, a in zip(call.tensor_positions, arrays))
        return Pending(call.signature, lowered, program, key, self.graphs.label, inputs)

    def _trace(self, call: _Call) -> TracedProgram:
        """Trace ``fn`` through torchax and export the program (StableHLO)."""
        from jax import export

        arrays, weights = call.arrays(), self.graphs.weights()
        donated = self._updated_inputs(call, weights, arrays)
        kept, donated_arrays = _split_donated(arrays, donated)
        structure: List[OutputStructure] = []
        jitted = jax.jit(self._program(call, donated, structure), donate_argnums=(2,),
                         out_shardings=_exported_shardings(donated_arrays))
        with self.graphs.lock, REGISTRY.recording() as selections:
            exported = export.export(jitted, platforms=(self.graphs.platform,))(weights, kept, donated_arrays)
        # The refusals that matter here are the JAX path's own kernels' (the C and eager
        # providers never serve a traced program).
        kernels = tuple(KernelChoice(s.op, s.shapes, s.provider.name, s.provider.jax_path,
                                     tuple((p.name, reason) for p, reason in s.refused if p.jax_path))
                        for s in selections)
        return TracedProgram(exported, donated, structure[0], kernels)

    def _onto_mesh(self, call: _Call) -> None:
        """Replicate over the mesh the inputs made elsewhere (a tensor moved with ``.to("jax")``
        sits on one chip), once: the tensor keeps the replicated array for later calls."""
        mesh_devices = self.graphs.replicated.device_set
        for i in call.tensor_positions:
            tensor = call.leaves[i]
            if tensor.jax().sharding.device_set != mesh_devices:
                tensor._elem = self.graphs.place(tensor.jax(), self.graphs.replicated)

    def _updated_inputs(self, call: _Call, weights, arrays) -> Tuple[int, ...]:
        """Which tensor inputs ``fn`` updates in place (found by tracing it once per structure)."""
        key = (call.signature.treedef, call.signature.static)
        if key not in self._mutated:
            found: List[int] = []
            with self.graphs.lock:
                jax.jit(self._program(call, (), [], report=found)).trace(weights, arrays, [])
            self._mutated[key] = tuple(found)
        return self._mutated[key]

    def _program(self, call: _Call, donated: Sequence[int], structure: List[OutputStructure],
                 report: Optional[List[int]] = None):
        """The JAX function of (weights, kept inputs, donated inputs) -> (output arrays, donated
        inputs as ``fn`` left them); ``structure`` receives the outputs' structure, ``report``
        the inputs ``fn`` updated."""
        graphs, fn = self.graphs, self.fn

        def program(weights, kept, donated_arrays):
            kept_iter, donated_iter = iter(kept), iter(donated_arrays)
            arrays = [next(donated_iter) if k in donated else next(kept_iter)
                      for k in range(len(call.tensor_positions))]
            leaves = list(call.signature.static)
            inputs = [JaxTensor(a, graphs.env) for a in arrays]
            for position, tensor in zip(call.tensor_positions, inputs):
                leaves[position] = tensor
            kwargs = pytree.tree_unflatten(leaves, call.signature.treedef)
            with graphs.env, _reparametrize_module(graphs.model, interop.torch_view(weights)):
                outputs, tensors = OutputStructure.of(fn(**kwargs))
            structure.append(outputs)
            if report is not None:
                report.extend(k for k, (tensor, a) in enumerate(zip(inputs, arrays)) if tensor.jax() is not a)
            return [t.jax() for t in tensors], [inputs[k].jax() for k in donated]
        return program
