"""Binding JAX kernels into torch: custom ops whose XLA implementation is ``call_jax``.

``torch_xla.core.xla_builder.call_jax`` lowers a JAX function (a Pallas kernel included: a
Mosaic custom call on TPU, plain HLO in interpret mode) and splices it into the lazy torch_xla
graph. Under torch.compile the call must sit behind a torch custom op with a fake function,
so dynamo traces shapes without running JAX; the real call happens when the openxla backend
replays the graph on XLA tensors.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np
import torch

from tpu_executor.kernels.registry import Provider
from tpu_executor.kernels.tpu_layout import lowering_chip


def on_tpu() -> bool:
    """True when torch_xla's PJRT runtime targets TPU (reads configuration, starts nothing).

    A process that has not loaded torch_xla has no XLA tensors, so no TPU provider could run:
    the answer is False without importing it (the native path never loads torch_xla).
    """
    if sys.modules.get("torch_xla") is None:  # never loaded, or marked absent
        return False
    import torch_xla.runtime as xr

    try:
        return xr.device_type() == "TPU"
    except Exception:  # noqa: BLE001 - an unconfigured runtime is simply not a TPU
        return False


def on_jax_tpu() -> bool:
    """True when the JAX path (already loaded) compiles for TPU chips: those of the mesh it
    traces for (its runtime sets it; they may be a TPU slice this machine compiles for without
    having it), else this process's own."""
    if sys.modules.get("torchax") is None:
        return False
    mesh = _mesh()
    if mesh is not None:
        return mesh.devices.flat[0].platform == "tpu"
    import jax

    return jax.devices()[0].platform == "tpu"




def is_xla_tensor(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "xla"


def is_jax_tensor(tensor) -> bool:
    """A torchax tensor (the JAX path): traced under ``jax.jit``, its values never on the host."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "jax"


def on_xla_if_fits(problem_fn: Callable) -> Callable[..., bool]:
    """A provider's ``supports_args``: XLA tensors whose shapes ``problem_fn`` finds no fault in."""
    def supports_args(first, *args, **kwargs):
        return is_xla_tensor(first) and problem_fn(first, *args, **kwargs) is None
    return supports_args


def eager_only(*args, **kwargs) -> bool:
    """A provider's ``supports_args`` for data-dependent eager code: untraced calls on a torch
    device (the native path), where reading a tensor's values on the host is allowed."""
    return not torch.compiler.is_compiling() and not any(is_xla_tensor(a) or is_jax_tensor(a) for a in args)


def first_problem(*checks: Callable[[], None]) -> Optional[str]:
    """The message of the first check that raises ValueError, or None when all pass."""
    for check in checks:
        try:
            check()
        except ValueError as err:
            return str(err)
    return None


def tpu_provider(name: str, priority: int, op_factory: Callable, problem_fn: Callable,
                 sources: Tuple[str, ...]) -> Provider:
    """A provider that runs a JAX kernel on TPU: only where torch_xla targets TPU, only for
    XLA tensors whose shapes ``problem_fn`` accepts, with int64 metadata cast to int32.
    ``op_factory`` builds the torch op on first use, so registering imports no JAX. Its
    module (the op's adapters) joins ``sources`` in the provider's source hash."""
    return Provider(name, with_int32_indices(op_factory), priority=priority, supported=on_tpu,
                    supports_args=on_xla_if_fits(problem_fn),
                    sources=(op_factory.__module__,) + tuple(sources))


def jax_tpu_provider(name: str, priority: int, jax_fn: Callable, problem_fn: Callable,
                     sources: Tuple[str, ...], split=None) -> Provider:
    """The JAX path's provider of a Pallas kernel: only where JAX runs on TPU, only for
    torchax tensors whose shapes ``problem_fn`` accepts. ``jax_fn`` (the same adapter the
    torch_xla binding calls) runs in the traced program, int64 metadata as int32.

    Under SPMD (a mesh of several chips) a kernel is an opaque custom call that XLA cannot
    partition: it runs per chip through ``shard_map`` as ``split`` says (``mesh_split.py``:
    attention over its heads, grouped matmul over the experts' split features), when the call
    splits over the chips and one chip's share passes ``problem_fn``; otherwise the reference
    serves."""
    def explain(first, *args, **kwargs) -> Optional[str]:
        if not is_jax_tensor(first):
            return "not a JAX-path tensor"
        problem = problem_fn(first, *args, **kwargs)
        chips = _mesh_size()
        if problem is not None or chips == 1:
            return problem
        if split is None:
            return f"an opaque kernel call cannot be split over {chips} chips"
        every = (first,) + args
        return split.problem(chips, every, kwargs) or problem_fn(*split.local_args(chips, every, kwargs), **kwargs)

    return Provider(name, functools.partial(call_on_jax, jax_fn, split), priority=priority, supported=on_jax_tpu,
                    supports_args=lambda *args, **kwargs: explain(*args, **kwargs) is None, explain=explain,
                    sources=(jax_fn.__module__, "tpu_executor.kernels.mesh_split") + tuple(sources), jax_path=True)


def torchax_env():
    """torchax's environment, usable from this thread.

    torchax keeps its environment's per-run properties (the mesh among them) in a thread-local
    that only the thread which built the environment has; an engine's worker runs on its
    executor's thread, and a later engine in the same process on another one. This thread gets
    the same start when it has none."""
    import jax
    import torchax
    from torchax.tensor import RuntimeProperty

    env = torchax.default_env()
    if not hasattr(env._property, "content"):
        env._property.content = [RuntimeProperty(mesh=None, prng=jax.random.key(0), autocast_dtype=None)]
    return env


def _mesh():
    """The mesh the JAX path traces for (its runtime sets it on torchax), or None."""
    return torchax_env().param.mesh


def _mesh_size() -> int:
    mesh = _mesh()
    return 1 if mesh is None else mesh.size


def call_on_jax(jax_fn: Callable, split, *args, **kwargs):
    """``jax_fn`` on torchax tensors (keyword arguments static), integer tensors as int32; on
    a mesh of several chips, per chip as ``split`` says (``mesh_split.py``)."""
    from torchax import interop

    args = [a.to(torch.int32) if isinstance(a, torch.Tensor) and a.dtype == torch.int64 else a for a in args]
    fn = functools.partial(call_exported_kernel, jax_fn, tuple(sorted(kwargs.items())))
    if _mesh_size() > 1:
        fn = split.wrap(fn, _mesh(), args, kwargs)
    return interop.call_jax(fn, *args)


_EXPORTED_KERNELS: Dict[Tuple, Any] = {}


def call_exported_kernel(jax_fn: Callable, static: Tuple, *arrays):
    """``jax_fn(*arrays, **dict(static))``. For a TPU (the chips of the mesh the JAX path
    traces for) the kernel is traced and lowered apart, with JAX's 64-bit mode off, and
    embedded in the calling program as a call; elsewhere (TPU interpret mode on a CPU, whose
    host callbacks cannot be exported) it is traced inline.

    The JAX path traces its programs with 64-bit mode on (64-bit seeds and token ids), and
    Pallas TPU kernels cannot be lowered under it (Mosaic's int64 -> int32 conversion rule
    recurses without end). One export per kernel, static arguments and operand shapes (every
    layer's call shares it)."""
    import jax
    from jax import export

    mesh = _mesh()
    if (mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()) != "tpu":
        return jax_fn(*arrays, **dict(static))  # TPU interpret mode on a CPU: plain HLO, no Mosaic
    key = (jax_fn, static, tuple((a.shape, a.dtype) for a in arrays))
    if key not in _EXPORTED_KERNELS:
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
        with jax.enable_x64(False), _one_chip_of(mesh):
            kernel = jax.jit(functools.partial(jax_fn, **dict(static)))
            _EXPORTED_KERNELS[key] = export.export(kernel, platforms=("tpu",))(*shapes)
    return _EXPORTED_KERNELS[key].call(*arrays)


def _one_chip_of(mesh):
    """A one-device abstract mesh of ``mesh``'s chip kind, unless a mesh context is already
    set (inside ``shard_map``): Pallas's TPU lowering reads the chip it lowers for from the
    mesh context, and a kernel exported apart has none of its own."""
    import contextlib

    import jax

    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    chip = mesh.abstract_mesh.abstract_device
    return lowering_chip(chip.device_kind, chip.num_cores)


@functools.lru_cache(maxsize=None)
def jax_backed_op(name: str, schema: str, jax_fn: Callable, fake: Callable):
    """Define ``torch.ops.tpu_executor.<name>`` once: XLA impl via call_jax, plus a fake.

    ``schema`` is the argument list in torch's schema language, e.g.
    ``"(Tensor lhs, Tensor rhs, Tensor group_sizes, *, bool transpose_rhs) -> Tensor"``.
    The schema ends with ``bool interpret=False`` (interpret mode, for proving the binding on
    CPU). Keyword arguments reach ``jax_fn`` as static values; ``jax_fn`` must be a module-level
    function because call_jax caches its lowering by the function's identity.
    """
    qualname = f"tpu_executor::{name}"
    torch.library.define(qualname, schema)

    def xla_impl(*args, **kwargs):
        from torch_xla.core.xla_builder import call_jax

        return call_jax(jax_fn, args, kwargs, name=name)

    def fake_impl(*args, interpret=False, **kwargs):
        return fake(*args, **kwargs)  # the spec's fake knows nothing of interpret mode

    torch.library.impl(qualname, "XLA", xla_impl)
    torch.library.register_fake(qualname, fake_impl)
    return getattr(torch.ops.tpu_executor, name)


def with_int32_indices(op_factory: Callable) -> Callable:
    """Call ``op_factory()`` with integer tensors cast to int32 first: the engine builds its
    metadata (lengths, block tables, slots) as int64, TPU kernels index with int32 (with
    JAX's default x64-off an int64 input would be narrowed anyway, with a warning)."""
    def call(*args, **kwargs):
        args = [a.to(torch.int32) if isinstance(a, torch.Tensor) and a.dtype == torch.int64 else a
                for a in args]
        return op_factory()(*args, **kwargs)
    return call


def torch_to_host(tensor: torch.Tensor):
    """A CPU torch tensor as a NumPy array of the same dtype (bf16 through fp32, FP8 through
    its bytes: NumPy has neither type of its own)."""
    import ml_dtypes

    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy().astype(ml_dtypes.bfloat16)
    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return tensor.numpy()


def torch_to_jax(tensor: torch.Tensor):
    """A CPU torch tensor as a JAX array of the same dtype."""
    import jax

    return jax.device_put(torch_to_host(tensor))


def jax_to_torch(array) -> torch.Tensor:
    """A JAX array as a CPU torch tensor of the same dtype."""
    import jax.numpy as jnp

    if array.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(array.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(array))
