"""Traced programs of the JAX path, kept on disk beside JAX's compile cache.

JAX's persistent cache maps a program's text to its executable, so even a warm start would
trace every graph through torchax to learn that text (most of a warm start's time: about 0.4 s
a graph for a 100M-parameter model here). The traced program is therefore exported
(``jax.export``, StableHLO) and stored under a key of the call's signature; a later start reads
it back, lowers it in milliseconds, and JAX's cache hands over the executable. Next to it lie
what the trace found: which inputs the function updates in place, and the structure of its
outputs.

The directory is keyed by everything a trace depends on (the checkpoint's config, the draft
model's, the engine config, the sources of this package and its kernels, the library versions,
the target: ``aot.job_parts``); a record that cannot be read is traced again, with a warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
import pickle
import tempfile
import warnings
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

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


class CheckedFolder:
    """One folder of a compile cache's pickled records (traced programs, executables), each
    file by key. ``expected`` (a compiled job read back: ``worker/jax/aot.py``): the sha256 of
    each file its manifest names; only those are read, each checked before it is unpickled (a
    file whose bytes differ is refused, naming it), and nothing is written. Otherwise files
    are read and written freely, and ``digests`` notes the sha256 of each one this process
    read or wrote (the manifest of a job being compiled). None: nothing is kept."""

    what = "file"  # how errors name a record

    def __init__(self, directory: Optional[str], expected: Optional[Mapping[str, str]] = None):
        self.directory = directory
        self.expected = None if expected is None else dict(expected)
        self.digests: Dict[str, str] = {}
        if directory is not None and expected is None:
            os.makedirs(directory, exist_ok=True)

    def read(self, key: str) -> Optional[bytes]:
        """The bytes of the record kept under ``key``, or None (none kept, or none the
        manifest names); a file that is not the manifest's raises ValueError."""
        if self.directory is None or (self.expected is not None and key not in self.expected):
            return None
        path = os.path.join(self.directory, key)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        if self.expected is not None and digest != self.expected[key]:
            raise ValueError(f"{self.what} {path} is not the file its job's manifest names (sha256 {digest[:16]}..., "
                             f"the manifest's {self.expected[key][:16]}...): refusing to load it; compile the job "
                             "again (tpu-executor compile)")
        self.digests[key] = digest
        return data

    def write(self, key: str, data: bytes) -> None:
        """Keep ``data`` under ``key`` (never into a job read back)."""
        if self.directory is None or self.expected is not None:
            return
        write_atomically(self.directory, key, data)
        self.digests[key] = hashlib.sha256(data).hexdigest()


class ProgramStore(CheckedFolder):
    """Traced programs in ``directory`` (None: nothing is kept)."""

    what = "traced program"

    def load(self, key: str) -> Optional[TracedProgram]:
        data = self.read(key)
        if data is None:
            return None
        try:
            from jax import export

            serialized, donated, outputs, kernels = pickle.loads(data)
            return TracedProgram(export.deserialize(bytearray(serialized)), tuple(donated), outputs, kernels)
        except Exception as err:  # noqa: BLE001 - any unreadable record is traced again
            warnings.warn(f"{self.what} {os.path.join(self.directory, key)} cannot be read "
                          f"({type(err).__name__}: {err}); tracing it again")
            return None

    def save(self, key: str, program: TracedProgram) -> None:
        """Write atomically: a start that reads concurrently sees the old file or the new one."""
        if self.directory is None or self.expected is not None:
            return
        self.write(key, pickle.dumps((bytes(program.exported.serialize()), program.donated, program.outputs,
                                      program.kernels)))


def write_atomically(directory: str, name: str, data: bytes) -> None:
    """A reader at the same time sees the old file or the new one, never a part."""
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".writing-")
    with os.fdopen(handle, "wb") as f:
        f.write(data)
    os.replace(temporary, os.path.join(directory, name))


class ExecutableStore(CheckedFolder):
    """Executables compiled ahead of time (``tpu-executor compile``), by program key, in
    ``directory`` (None: none are kept). The format is JAX's ``serialize_executable``, which is
    pickle-based: only files this package wrote are loaded, from a directory the user named,
    and only those whose sha256 is the one the job's manifest holds. An executable runs only
    under the platform, chips and compiler that built it: the directory's key names them
    (``worker/jax/aot.py``)."""

    what = "executable"

    def __init__(self, directory: Optional[str], writes: bool = False, expected: Optional[Mapping[str, str]] = None):
        super().__init__(directory, expected)
        self.writes = writes and directory is not None and expected is None  # the compile command keeps what compiles

    def save(self, key: str, compiled) -> None:
        from jax.experimental.serialize_executable import serialize

        if self.writes:
            self.write(key, pickle.dumps(serialize(compiled)))

    def load(self, key: str):
        """The executable kept under ``key`` loaded onto this process's devices, or None."""
        data = self.read(key)
        if data is None:
            return None
        from jax.experimental.serialize_executable import deserialize_and_load

        try:
            payload, in_tree, out_tree = pickle.loads(data)
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as err:  # noqa: BLE001 - an executable that cannot load is compiled again
            warnings.warn(f"{self.what} {os.path.join(self.directory, key)} cannot be loaded "
                          f"({type(err).__name__}: {err}); compiling it")
            return None
