"""Builds and loads the native path's C kernels (``*.c`` beside their ops, ``cpu_vectors.h``).

A library is compiled on the native path's first call of its op (never on the XLA, JAX or
CUDA paths, whose tensors it does not take) with the machine's C compiler (``cc`` or ``gcc``,
OpenMP, ``-march=native``, at most ``BUILD_TIMEOUT_S``) into ``~/.cache/tpu_executor/kernels``,
keyed by its source, the shared header, the flags, the compiler's version, the machine's
architecture and this CPU's features, so a home directory shared by different CPUs or
compilers never loads a foreign binary. Without a compiler, or where the build fails, there is
no library (a WARNING says so) and the ops' torch providers serve.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from tpu_executor.kernels.registry import Provider

logger = logging.getLogger(__name__)

HEADER = os.path.join(os.path.dirname(__file__), "cpu_vectors.h")
# Beside the project's other caches (models, XLA's compile cache).
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", "kernels")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 300


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for; x86's ``flags``, Arm's
    ``Features``; Linux only)."""
    with open("/proc/cpuinfo") as info:
        return next((line for line in info if line.startswith(("flags", "Features"))), "")


@functools.lru_cache(maxsize=None)
def _compiler() -> Optional[Tuple[str, str]]:
    """(path, version line) of the C compiler, or None without one (or off Linux)."""
    path = shutil.which("cc") or shutil.which("gcc")
    if path is None or not os.path.exists("/proc/cpuinfo"):
        return None
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return path, version.splitlines()[0] if version else "unknown"


def can_build() -> bool:
    """A static check for the registry: a C compiler is here (building waits for a first call)."""
    return _compiler() is not None


def c_provider(native, function: Callable):
    """The registry's provider of an op's C kernel (``native``: its ``cpu_native`` module, with
    ``supports_args`` and ``supported``): statically usable where a compiler is; per call it
    takes what ``supports_args`` takes (CPU tensors outside a trace), once the kernel is built,
    so the first such call builds it."""
    def supports_args(*args, **kwargs) -> bool:
        return native.supports_args(*args, **kwargs) and native.supported()

    return Provider("cpu_c", function, priority=6, supported=can_build, supports_args=supports_args)


def built_with_wide_vectors(kernel: "CFunction", wide: "CFunction", op: str, serving: str) -> bool:
    """``kernel`` builds here and its library was compiled with AVX-512's registers (``wide()``
    answers 1). A kernel built without them stands aside, with a warning once per process: its
    tiles would spill AVX2's registers and run slower than ``serving``."""
    if not kernel.supported():
        return False
    if not wide():
        _stands_aside(op, serving)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _stands_aside(op: str, serving: str) -> None:
    logger.warning("this CPU has no AVX-512: the native path's %s C kernel stands aside and %s serves, "
                   "more slowly than on an AVX-512 CPU", op, serving)


def _compile(compiler: str, source: str, target: str) -> None:
    """Compile into a temporary file, then move it into place (ranks may build at once)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target))
    os.close(handle)
    try:
        subprocess.run([compiler, *CFLAGS, "-I", os.path.dirname(HEADER), "-o", partial, source], check=True,
                       capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


@functools.lru_cache(maxsize=None)
def build(source: str) -> Optional[ctypes.CDLL]:
    """The library compiled from ``source`` (once per source, header, flags and CPU), or None
    where it cannot be built here."""
    name = os.path.splitext(os.path.basename(source))[0]
    found = _compiler()
    if found is None:
        logger.warning("no C compiler (cc or gcc; or not Linux): the native path's %s kernel is not built and "
                       "torch ops serve its op, more slowly", name)
        return None
    compiler, version = found
    identity = (repr(CFLAGS), version, platform.machine(), _cpu_features())
    digest = hashlib.sha256("\n".join(identity).encode())
    for path in (source, HEADER):
        with open(path, "rb") as text:
            digest.update(text.read())
    target = os.path.join(CACHE_DIR, f"{name}_{digest.hexdigest()[:16]}.so")
    try:
        if not os.path.exists(target):
            _compile(compiler, source, target)
        return ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as err:
        logger.warning("building the CPU kernel %s failed (%s); using torch ops", name,
                       getattr(err, "stderr", "") or err)
        return None


@functools.lru_cache(maxsize=None)
def kernel(source: str, name: str, argtypes: Sequence, restype=None):
    """Function ``name`` of ``source``'s library with its C signature set, or None where the
    library cannot be built here."""
    library = build(source)
    if library is None:
        return None
    function = getattr(library, name)
    function.argtypes, function.restype = list(argtypes), restype
    return function


@dataclass(frozen=True)
class CFunction:
    """One function of an op's C kernel (``source``, beside its ``cpu_native.py``), built and
    loaded on first use: ``supported()`` for the provider's static check, called like the
    function itself."""

    source: str
    name: str
    argtypes: Tuple
    restype: object = None

    @functools.cached_property
    def loaded(self):
        """The function with its C signature set, or None where the library cannot be built
        (looked up once: a decode step makes hundreds of calls)."""
        return kernel(self.source, self.name, self.argtypes, self.restype)

    def supported(self) -> bool:
        """A static check: the kernel builds and loads on this machine."""
        return self.loaded is not None

    def __call__(self, *args):
        return self.loaded(*args)


def heads_contiguous(x: torch.Tensor) -> bool:
    """x ``[T, heads, d]`` with each token's heads contiguous (the token stride free: q's or k's
    heads may be a view inside a wider QKV row), as the C kernels read them."""
    return x.dim() == 3 and x.stride()[1:] == (x.shape[2], 1)


def untraced_fp32_cpu(*tensors) -> bool:
    """Every one an fp32 CPU tensor, outside a traced graph: what the C kernels take. (A CPU
    tensor is never an XLA or JAX one, so its device is the whole eager check.)"""
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.float32
               for t in tensors) and not torch.compiler.is_compiling()
