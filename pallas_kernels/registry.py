"""The op registry: one op, several providers, picked by priority and a selection string.

A provider declares a static ``supported()`` (can it run here at all: platform, installed
packages) and a per-call ``supports_args(*args, **kwargs)`` (shapes, dtypes, block
constraints). Among the enabled providers of an op the one with the highest priority whose
checks pass runs. The torch reference of each op is registered with the lowest priority and
accepts everything, so dispatch always succeeds.

The selection string names which non-reference providers are enabled, by op name:
``"all"`` (default), ``"none"``, ``"all,-paged_attention"``, ``"none,+gmm"``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch


def _always() -> bool:
    return True


def _accept_all(*args, **kwargs) -> bool:
    return True


@dataclass(frozen=True)
class Provider:
    """One implementation of an op."""

    name: str
    fn: Callable
    priority: int
    supported: Callable[[], bool] = _always
    supports_args: Callable[..., bool] = _accept_all
    is_reference: bool = False
    sources: Tuple[str, ...] = ()  # modules whose code the provider runs, e.g. its kernel
    jax_path: bool = False  # runs inside the JAX path's traced programs (a Pallas kernel there)
    explain: Optional[Callable[..., Optional[str]]] = None  # why ``supports_args`` refuses a call

    def refusal(self, *args, **kwargs) -> str:
        """Why this provider does not take a call it refused."""
        reason = self.explain(*args, **kwargs) if self.explain is not None else None
        return reason or "its shapes or dtypes are not supported"

    def source_hash(self) -> str:
        """Hash of the provider's source: a change to a kernel invalidates compiled graphs.

        Covers the module defining ``fn`` and every module named in ``sources``; the files
        are read, not imported, so hashing a TPU kernel does not import JAX.
        """
        digest = hashlib.sha256(self.name.encode())
        module = inspect.getmodule(self.fn)
        names = ((module.__name__,) if module else ()) + self.sources
        for name in names:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin is None:
                raise ValueError(f"provider {self.name!r}: cannot find source module {name!r}")
            with open(spec.origin, "rb") as source:
                digest.update(source.read())
        return digest.hexdigest()[:16]


@dataclass(frozen=True)
class Selection:
    """One dispatch seen while recording: the op, the shapes of its tensor arguments, the
    provider that ran, and each better provider that refused the call with its reason."""

    op: str
    shapes: str
    provider: Provider
    refused: Tuple[Tuple[Provider, str], ...] = ()


class OpRegistry:
    """Providers per op name, with the selection that enables or disables them."""

    def __init__(self):
        self._providers: Dict[str, List[Provider]] = {}
        self._enabled: Dict[str, bool] = {}
        self._usable_cache: Dict[str, List[Provider]] = {}

    def register(self, op: str, provider: Provider) -> None:
        providers = self._providers.setdefault(op, [])
        if any(p.name == provider.name for p in providers):
            raise ValueError(f"op {op!r} already has a provider named {provider.name!r}")
        providers.append(provider)
        providers.sort(key=lambda p: -p.priority)
        self.refresh()

    def ops(self) -> List[str]:
        return sorted(self._providers)

    def providers(self, op: str) -> List[Provider]:
        if op not in self._providers:
            raise KeyError(f"unknown op {op!r}; known ops: {self.ops()}")
        return list(self._providers[op])

    def configure(self, selection: str = "all") -> None:
        """Apply a selection string such as ``"all,-paged_attention"``."""
        parts = [p.strip() for p in selection.split(",") if p.strip()]
        if not parts or parts[0] not in ("all", "none"):
            raise ValueError(f"op selection must start with 'all' or 'none', got {selection!r}")
        enabled = {op: parts[0] == "all" for op in self._providers}
        for part in parts[1:]:
            sign, op = part[0], part[1:]
            if sign not in "+-" or op not in self._providers:
                raise ValueError(f"bad op selection item {part!r}; use +op or -op with op in {self.ops()}")
            enabled[op] = sign == "+"
        self._enabled = enabled
        self.refresh()

    def refresh(self) -> None:
        """Run the providers' static checks again (after the process loaded a runtime, e.g.
        torch_xla)."""
        # Static checks run once per registration or configuration, never while tracing:
        # state that changed under torch.compile would fail its guards and recompile. For the
        # same reason an unchanged result keeps the very same objects.
        usable = {op: [p for p in providers if (p.is_reference or self._enabled.get(op, True)) and p.supported()]
                  for op, providers in self._providers.items()}
        if usable != self._usable_cache:
            self._usable_cache = usable

    def _usable(self, op: str) -> List[Provider]:
        if op not in self._usable_cache:
            raise KeyError(f"unknown op {op!r}; known ops: {self.ops()} (call tpu_executor.kernels.register_all())")
        return self._usable_cache[op]

    def select(self, op: str, *args, **kwargs) -> Provider:
        """The provider that runs this call (noted, with the providers that refused it, while
        ``recording``)."""
        usable = self._usable(op)
        for index, provider in enumerate(usable):
            if provider.is_reference or provider.supports_args(*args, **kwargs):
                if self._is_recording():
                    refused = tuple((i, usable[i].refusal(*args, **kwargs)) for i in range(index))
                    _note_selection(id(self), op, _shapes(args), index, refused)
                return provider
        raise RuntimeError(f"op {op!r} has no reference provider")

    def _is_recording(self) -> bool:
        # Under torch.compile the answer is read once per trace and never guarded: a guard on
        # it would recompile every graph traced while recording once recording stops.
        if torch.compiler.is_compiling():
            return _recording_while_tracing(id(self))
        return id(self) in _RECORDINGS

    @contextlib.contextmanager
    def recording(self):
        """Within this block every dispatch is noted in the yielded list (``Selection``);
        under torch.compile, every dispatch traced in it."""
        outer = _RECORDINGS.get(id(self))
        selections: List[Selection] = []
        _RECORDINGS[id(self)] = (self, selections)
        try:
            yield selections
        finally:
            if outer is None:
                del _RECORDINGS[id(self)]
            else:
                _RECORDINGS[id(self)] = outer

    def dispatch(self, op: str, *args, **kwargs):
        return self.select(op, *args, **kwargs).fn(*args, **kwargs)

    def fingerprint(self, jax_path: bool = False) -> str:
        """Source hashes of the usable providers: part of the compile-cache key. For the JAX
        path (``jax_path``), those of every provider its programs can hold, usable here or
        not: a program compiled here for a TPU holds the TPU's kernels, and the machine that
        loads it must compute the same key whatever its own compiler or CPU offers."""
        if jax_path:
            providers = [(op, p) for op in self.ops() for p in self._providers[op] if p.is_reference or p.jax_path]
        else:
            providers = [(op, p) for op in self.ops() for p in self._usable(op)]
        parts = [f"{op}:{p.name}:{p.source_hash()}" for op, p in providers]
        if jax_path:
            parts.append(repr(sorted(op for op, enabled in self._enabled.items() if not enabled)))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


# Registries recording now, by id: (registry, the selections noted so far).
_RECORDINGS: Dict[int, Tuple["OpRegistry", List[Selection]]] = {}


@torch.compiler.assume_constant_result
def _recording_while_tracing(registry_id: int) -> bool:
    return registry_id in _RECORDINGS


@torch.compiler.assume_constant_result
def _note_selection(registry_id: int, op: str, shapes: str, index: int,
                    refused: Tuple[Tuple[int, str], ...]) -> bool:
    """Note one dispatch; called as a constant under torch.compile, so it runs once per trace."""
    registry, selections = _RECORDINGS[registry_id]
    usable = registry._usable(op)
    selections.append(Selection(op, shapes, usable[index], tuple((usable[i], why) for i, why in refused)))
    return True


def _shapes(args) -> str:
    """The shapes and dtypes of a call's tensor arguments, e.g. ``[8, 4, 128] bf16, [8] i32``."""
    described = []
    for arg in args:
        if hasattr(arg, "shape") and hasattr(arg, "dtype"):
            dtype = str(arg.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "f")
            described.append(f"{list(arg.shape)} {dtype.replace('int', 'i')}")
    return ", ".join(described)


REGISTRY = OpRegistry()
