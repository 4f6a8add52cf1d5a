"""Compiled graphs on the JAX path: the runner's torch step functions, traced by torchax and
compiled with ``jax.jit``, one executable per bucket.

A ``JaxFunction`` takes the same keyword arguments as the torch function it wraps. Tensor
arguments (torchax tensors) are the executable's inputs; every other argument (ints, bools,
None) is static and part of the executable's key, like the bucket's shapes. The model's
weights are inputs too, never constants baked into the program. An input the function
updates in place (the KV cache, the logits-processing state) comes back as an output and is
donated, so XLA writes it where it lies instead of copying it each step; after the call the
caller's tensor holds the new buffer, as after an in-place torch op.

Executables are built in two moves: ``lower`` (tracing the torch code: Python, one at a time)
and ``compile`` (XLA: releases the GIL, so a thread pool compiles several at once). JAX's
persistent cache answers ``compile`` when an identical program was compiled before.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from torchax import interop
from torchax.tensor import Tensor as JaxTensor


class CallSignature(NamedTuple):
    """What picks an executable: the arguments' structure, static values, shapes and dtypes."""

    treedef: Any
    static: Tuple
    shapes: Tuple


class _Call(NamedTuple):
    signature: CallSignature
    leaves: List[Any]
    tensor_positions: Tuple[int, ...]


class Pending(NamedTuple):
    """A lowered program waiting for XLA (``JaxFunction.compile`` finishes it)."""

    function: "JaxFunction"
    signature: CallSignature
    lowered: Any
    donated: Tuple[int, ...]


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


class JaxGraphs:
    """The compiled functions of one model runner: the weights they read, the torchax
    environment they trace in, and the executables built so far (shared by its functions)."""

    def __init__(self, model: torch.nn.Module, env, replicated):
        self.model = model
        self.env = env
        # Every output is replicated over the mesh (logits are gathered, as Megatron's LM head
        # does), so the next graph that takes it always finds the placement it was compiled for.
        self.replicated = replicated
        self.lock = threading.Lock()
        self._weights: Optional[Dict[str, Any]] = None
        self._pool: Optional[ThreadPoolExecutor] = None
        self.compiling: List[Future] = []

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

    def function(self, fn: Callable) -> "JaxFunction":
        return JaxFunction(fn, self)


class JaxFunction:
    """``fn`` (a torch function of keyword arguments) compiled per call signature."""

    def __init__(self, fn: Callable, graphs: JaxGraphs):
        self.fn = fn
        self.graphs = graphs
        self.executables: Dict[CallSignature, Tuple[Any, Tuple[int, ...]]] = {}
        self._mutated: Dict[Tuple, Tuple[int, ...]] = {}  # (treedef, static) -> updated inputs
        self._out_info: Dict[CallSignature, Any] = {}  # outputs' shapes, while compiling ahead

    def __call__(self, **kwargs):
        call = _split(kwargs)
        entry = self.executables.get(call.signature)
        if entry is None and self.graphs._pool is not None:
            return self._compile_ahead(call, kwargs)
        if entry is None:
            self.compile(self.lower(**kwargs))
            entry = self.executables[call.signature]
        executable, donated = entry
        arrays = [call.leaves[i].jax() for i in call.tensor_positions]
        kept = [a for k, a in enumerate(arrays) if k not in donated]
        outputs, updated = executable(self.graphs.weights(), kept, [arrays[k] for k in donated])
        for k, array in zip(donated, updated):
            call.leaves[call.tensor_positions[k]]._elem = array
        return interop.torch_view(outputs)

    def lower(self, **kwargs) -> Optional[Pending]:
        """Trace ``fn`` for these arguments' signature; None when it is compiled already."""
        call = _split(kwargs)
        if call.signature in self.executables:
            return None
        self._onto_mesh(call)
        arrays = [call.leaves[i].jax() for i in call.tensor_positions]
        weights = self.graphs.weights()
        donated = self._updated_inputs(call, weights, arrays)
        kept = [a for k, a in enumerate(arrays) if k not in donated]
        # State updated in place stays where it was placed (a KV cache split over its heads).
        out_shardings = (self.graphs.replicated, [arrays[k].sharding for k in donated])
        program = jax.jit(self._program(call, donated), donate_argnums=(2,), out_shardings=out_shardings)
        with self.graphs.lock:
            lowered = program.trace(weights, kept, [arrays[k] for k in donated]).lower()
        return Pending(self, call.signature, lowered, donated)

    def _compile_ahead(self, call: _Call, kwargs):
        """Lower now, compile on the pool, answer with zeros shaped like the outputs."""
        import numpy as np

        if call.signature not in self._out_info:
            pending = self.lower(**kwargs)
            self._out_info[call.signature] = pending.lowered.out_info[0]
            self.graphs.compiling.append(self.graphs._pool.submit(self.compile, pending))
        # Host zeros moved over: an eager jnp.zeros would compile a program of its own.
        zeros = jax.tree_util.tree_map(lambda info: jax.device_put(np.zeros(info.shape, info.dtype),
                                                                   self.graphs.replicated),
                                       self._out_info[call.signature])
        return interop.torch_view(zeros)

    def compile(self, pending: Optional[Pending]) -> None:
        """Compile a lowered program (XLA's work: safe on a worker thread)."""
        if pending is not None:
            self.executables[pending.signature] = (pending.lowered.compile(), pending.donated)

    def _onto_mesh(self, call: _Call) -> None:
        """Replicate over the mesh the inputs made elsewhere (a tensor moved with ``.to("jax")``
        sits on one chip), once: the tensor keeps the replicated array for later calls."""
        mesh_devices = self.graphs.replicated.device_set
        for i in call.tensor_positions:
            tensor = call.leaves[i]
            if tensor.jax().sharding.device_set != mesh_devices:
                tensor._elem = jax.device_put(tensor.jax(), self.graphs.replicated)

    def _updated_inputs(self, call: _Call, weights, arrays) -> Tuple[int, ...]:
        """Which tensor inputs ``fn`` updates in place (found by tracing it once per structure)."""
        key = (call.signature.treedef, call.signature.static)
        if key not in self._mutated:
            found: List[int] = []
            program = self._program(call, (), report=found)
            with self.graphs.lock:
                jax.jit(program).trace(weights, arrays, [])
            self._mutated[key] = tuple(found)
        return self._mutated[key]

    def _program(self, call: _Call, donated: Sequence[int], report: Optional[List[int]] = None):
        """The JAX function of (weights, kept inputs, donated inputs) -> (outputs, donated inputs
        as ``fn`` left them). ``report`` collects the inputs ``fn`` updated."""
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
                outputs = fn(**kwargs)
            if report is not None:
                report.extend(k for k, (tensor, a) in enumerate(zip(inputs, arrays)) if tensor.jax() is not a)
            return interop.jax_view(outputs), [inputs[k].jax() for k in donated]
        return program
