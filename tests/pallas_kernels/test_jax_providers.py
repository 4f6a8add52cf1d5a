"""The JAX path's kernel providers: each op's Pallas kernel called inline on torchax tensors,
inside a ``jax.jit``-traced program as the JAX path runs it, against THE reference on the op's
generated cases (TPU interpret mode, in a fresh interpreter); and their dispatch rules."""
import importlib

import pytest
import torch

from tests.pallas_kernels.kernel_cases import generated_cases, in_fresh_process
from tpu_executor.kernels import register_all
from tpu_executor.kernels.binding import torchax_env
from tpu_executor.kernels.registry import OpRegistry

KERNEL_OPS = ("paged_attention", "prefill_attention", "gmm")
CASES_PER_OP = 6


def ops_module(op: str):
    return importlib.import_module(f"tpu_executor.kernels.{op}.ops")


def jax_provider(op: str):
    return next(p for p in register_all(OpRegistry()).providers(op) if p.name == "pallas_jax")


def run_traced(provider, case):
    """``provider`` on the case's tensors as torchax tensors, traced and compiled by jax.jit."""
    import jax
    from jax.experimental import enable_x64
    from jax.experimental.pallas import tpu as pltpu
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax

    env = torchax_env()
    tensors = [torch_to_jax(a) for a in case.args]

    def program(*arrays):
        with env:
            return interop.jax_view(provider.fn(*interop.torch_view(arrays), **case.kwargs))

    with enable_x64(), pltpu.force_tpu_interpret_mode():
        return jax_to_torch(jax.jit(program)(*tensors))


def check_op(op: str) -> int:
    """The provider within tolerance of the reference on the first cases its kernel takes."""
    module = ops_module(op)
    provider = jax_provider(op)
    checked = 0
    for case in generated_cases(module.SPEC, seed=7):
        if module.shape_problem(*case.args, **case.kwargs) is not None:
            continue
        module.SPEC.assert_close(run_traced(provider, case), case.run(module.SPEC.reference), case.label)
        checked += 1
        if checked == CASES_PER_OP:
            break
    return checked


@pytest.mark.slow  # TPU interpret mode
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_jax_provider_matches_reference_on_generated_cases(op):
    assert in_fresh_process(check_op, op) == CASES_PER_OP


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_jax_provider_takes_torchax_tensors_only_and_only_on_tpu(op):
    provider = jax_provider(op)
    assert provider.supported() is False  # no TPU here
    case = next(c for c in generated_cases(ops_module(op).SPEC, seed=7)
                if ops_module(op).shape_problem(*c.args, **c.kwargs) is None)
    assert not provider.supports_args(*case.args, **case.kwargs)  # CPU tensors: not the JAX path
    assert ops_module(op).KERNEL_MODULE in provider.sources


def first_case(op: str, kv_heads: int):
    module = ops_module(op)
    return next(c for c in generated_cases(module.SPEC, seed=7)
                if module.shape_problem(*c.args, **c.kwargs) is None and c.args[1].shape[0] == kv_heads)


@pytest.mark.parametrize("op, kv_heads, on_two_chips", [
    ("paged_attention", 2, True), ("paged_attention", 1, False),
    ("prefill_attention", 2, True), ("prefill_attention", 1, False), ("gmm", None, False)])
def test_jax_provider_on_a_mesh_needs_heads_that_divide(op, kv_heads, on_two_chips):
    """Under SPMD an attention kernel runs per chip over its heads (both head counts must
    divide over the chips); gmm has no such split: there the reference serves."""
    import types

    provider = jax_provider(op)
    case = first_case(op, kv_heads) if kv_heads else next(
        c for c in generated_cases(ops_module(op).SPEC, seed=7) if ops_module(op).shape_problem(*c.args) is None)
    env = torchax_env()
    with env:
        args = [a.to("jax") if isinstance(a, torch.Tensor) else a for a in case.args]
        for chips, accepted in ((1, True), (2, on_two_chips)):
            with env.override_property(mesh=types.SimpleNamespace(size=chips)):
                assert provider.supports_args(*args, **case.kwargs) is accepted


def run_over_two_chips(op: str) -> int:
    """``mesh_split.HEADS`` (how the provider wraps its kernel on a mesh) around the op's
    reference on two virtual CPU chips, each with its share of the heads, against the
    reference on the whole arrays. (Pallas's TPU interpret mode cannot run across several
    devices of one process, so the kernel itself is checked per chip by the cases above.)"""
    import functools
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.experimental import enable_x64
    from jax.sharding import Mesh
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax
    from tpu_executor.kernels.mesh_split import HEADS

    module, env = ops_module(op), torchax_env()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    checked = 0
    for case in generated_cases(module.SPEC, seed=7):
        if case.args[1].shape[0] % 2:
            continue

        def reference(*arrays):
            with env:
                return interop.jax_view(module.SPEC.reference(*interop.torch_view(arrays), **case.kwargs))

        split = HEADS.wrap(functools.partial(reference), mesh, len(case.args), case.kwargs)
        with enable_x64():
            got = jax_to_torch(jax.jit(split)(*[torch_to_jax(a) for a in case.args]))
        module.SPEC.assert_close(got, case.run(module.SPEC.reference), case.label)
        checked += 1
        if checked == 3:
            return checked
    return checked


@pytest.mark.slow  # JAX over virtual devices, in a fresh interpreter
@pytest.mark.parametrize("op", ["paged_attention", "prefill_attention"])
def test_attention_split_over_the_heads_of_two_chips_matches_reference(op):
    assert in_fresh_process(run_over_two_chips, op) == 3


def test_eager_providers_decline_torchax_tensors():
    """Data-dependent eager providers read values on the host: never under jax.jit."""
    from tpu_executor.kernels.binding import eager_only

    with torchax_env():
        assert not eager_only(torch.zeros(2, device="jax"))
    assert eager_only(torch.zeros(2))


def test_torchax_environment_serves_threads_that_did_not_build_it():
    """An engine's worker runs on its executor's thread, a later engine on another one."""
    import threading

    import torchax

    torchax_env()  # built (or already built) on this thread
    seen = []

    def on_another_thread():
        seen.append(hasattr(torchax.default_env()._property, "content"))
        seen.append(torchax_env().param.mesh)

    thread = threading.Thread(target=on_another_thread)
    thread.start()
    thread.join()
    assert seen == [False, None]
