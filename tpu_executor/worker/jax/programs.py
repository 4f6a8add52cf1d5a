"""Traced programs of the JAX path, kept on disk beside JAX's compile cache.

JAX's persistent cache maps a program's text to its executable, so even a warm start would
trace every graph through torchax to learn that text (most of a warm start's time: about 0.4 s
a graph for a 100M-parameter model here). The traced program is therefore exported
(``jax.export``, StableHLO) and stored under a key of the call's signature; a later start reads
it back, lowers it in milliseconds, and JAX's cache hands over the executable. Next to it lie
what the trace found: which inputs the function updates in place, and the structure of its
outputs.

The directory is keyed by everything a trace depends on (the checkpoint's config, the engine
config and bucket plan, the sources of this package and its kernels, the library versions:
``runtime.compile_cache_key``); a record that cannot be read is traced again, with a warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import warnings
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

logger = logging.getLogger(__name__)


class OutputStructure(NamedTuple):
    """How a function's outputs are rebuilt from the program's flat list of arrays."""

    spec: Any  # torch pytree spec of the outputs
    constants: Tuple  # the non-tensor leaves (None at tensor positions)
    tensor_positions: Tuple[int, ...]

    @staticmethod
    def of(outputs) -> Tuple["OutputStructure", List[torch.Tensor]]:
        leaves, spec = pytree.tree_flatten(outputs)
        positions = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
        constants = tuple(None if i in positions else leaf for i, leaf in enumerate(leaves))
        return OutputStructure(spec, constants, positions), [leaves[i] for i in positions]

    def rebuild(self, tensors: List[torch.Tensor]):
        leaves = list(self.constants)
        for position, tensor in zip(self.tensor_positions, tensors):
            leaves[position] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


class KernelChoice(NamedTuple):
    """The provider a traced program holds for one op call, and the better ones that refused
    it (``(provider, reason)``); ``pallas``: the chosen one is a Pallas kernel."""

    op: str
    shapes: str
    provider: str
    pallas: bool
    refused: Tuple[Tuple[str, str], ...]


def refusal_lines(choices) -> List[str]:
    """One line per op and shapes where a Pallas kernel refused a call that another provider
    serves (each once, however many layers and graphs repeat it)."""
    lines: List[str] = []
    for choice in choices:
        for provider, reason in choice.refused:
            line = f"{choice.op} at [{choice.shapes}]: {provider} refused ({reason}); {choice.provider} serves it"
            if line not in lines:
                lines.append(line)
    return lines


class TracedProgram(NamedTuple):
    """One call signature's exported program, the inputs it updates, its outputs' structure,
    and the kernel providers its trace chose."""

    exported: Any  # jax.export.Exported
    donated: Tuple[int, ...]
    outputs: OutputStructure
    kernels: Tuple[KernelChoice, ...] = ()


def program_key(name: str, signature) -> str:
    """A file name for a function's program at one call signature (stable across processes)."""
    text = repr((name, str(signature.treedef), signature.static, signature.shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class ProgramStore:
    """Traced programs in ``directory`` (None: nothing is kept)."""

    def __init__(self, directory: Optional[str]):
        self.directory = directory
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    def load(self, key: str) -> Optional[TracedProgram]:
        if self.directory is None:
            return None
        path = os.path.join(self.directory, key)
        if not os.path.exists(path):
            return None
        try:
            from jax import export

            with open(path, "rb") as f:
                serialized, donated, outputs, kernels = pickle.load(f)
            return TracedProgram(export.deserialize(bytearray(serialized)), tuple(donated), outputs, kernels)
        except Exception as err:  # noqa: BLE001 - any unreadable record is traced again
            warnings.warn(f"traced program {path} cannot be read ({type(err).__name__}: {err}); tracing it again")
            return None

    def save(self, key: str, program: TracedProgram) -> None:
        """Write atomically: a start that reads concurrently sees the old file or the new one."""
        if self.directory is None:
            return
        record = pickle.dumps((bytes(program.exported.serialize()), program.donated, program.outputs,
                               program.kernels))
        write_atomically(self.directory, key, record)


def write_atomically(directory: str, name: str, data: bytes) -> None:
    """A reader at the same time sees the old file or the new one, never a part."""
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".writing-")
    with os.fdopen(handle, "wb") as f:
        f.write(data)
    os.replace(temporary, os.path.join(directory, name))


class ExecutableStore:
    """Executables compiled ahead of time (``tpu-executor compile``), by program key, in
    ``directory`` (None: none are kept). The format is JAX's ``serialize_executable``, which is
    pickle-based: only files this package wrote are ever loaded, from a directory the user
    named. An executable runs only under the platform, chips and compiler that built it: the
    directory's key names them (``worker/jax/aot.py``)."""

    def __init__(self, directory: Optional[str], writes: bool = False):
        self.directory = directory
        self.writes = writes and directory is not None  # keeps what compiles (the compile command)
        if directory is not None:
            os.makedirs(directory, exist_ok=True)

    def save(self, key: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        if self.writes:
            write_atomically(self.directory, key, pickle.dumps(serialize(compiled)))

    def load(self, key: str):
        """The executable kept under ``key`` loaded onto this process's devices, or None."""
        path = None if self.directory is None else os.path.join(self.directory, key)
        if path is None or not os.path.exists(path):
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as err:  # noqa: BLE001 - an executable that cannot load is compiled again
            warnings.warn(f"executable {path} cannot be loaded ({type(err).__name__}: {err}); compiling it")
            return None
