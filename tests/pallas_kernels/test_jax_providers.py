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

KERNEL_OPS = ("paged_attention", "prefill_attention", "gmm", "w8a16_matmul", "w4a16_matmul", "w8a8_matmul")
CASES_PER_OP = 6


def ops_module(op: str):
    return importlib.import_module(f"tpu_executor.kernels.{op}.ops")


def jax_provider(op: str):
    return next(p for p in register_all(OpRegistry()).providers(op) if p.name == "pallas_jax")


def run_traced(provider, case):
    """``provider`` on the case's tensors as torchax tensors, traced and compiled by jax.jit."""
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax

    env = torchax_env()
    tensors = [torch_to_jax(a) for a in case.args]

    def program(*arrays):
        with env:
            return interop.jax_view(provider.fn(*interop.torch_view(arrays), **case.kwargs))

    with jax.enable_x64(True), pltpu.force_tpu_interpret_mode():
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


def accepted_on(provider, args, kwargs, chips: int) -> bool:
    import types

    env = torchax_env()
    with env:
        args = [a.to("jax") if isinstance(a, torch.Tensor) else a for a in args]
        with env.override_property(mesh=types.SimpleNamespace(size=chips)):
            return provider.supports_args(*args, **kwargs)


@pytest.mark.parametrize("op", ["paged_attention", "prefill_attention"])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_attention_on_a_mesh_needs_heads_that_divide(op, kv_heads):
    """Under SPMD an attention kernel runs per chip over its heads: the query heads must divide
    over the chips, and the KV heads too unless there is one (replicated, read by every chip)."""
    provider, case = jax_provider(op), first_case(op, kv_heads)
    heads = case.args[0].shape[1]
    assert accepted_on(provider, case.args, case.kwargs, 1)
    assert accepted_on(provider, case.args, case.kwargs, 2) == (heads % 2 == 0 and (kv_heads == 1 or kv_heads % 2 == 0))
    assert not accepted_on(provider, case.args, case.kwargs, 3)


def test_gmm_on_a_mesh_needs_the_split_of_its_weights():
    """gmm runs per chip only when the caller says how the expert weights are split and they
    split evenly over the chips."""
    provider = jax_provider("gmm")
    lhs, sizes = torch.randn(64, 256), torch.tensor([30, 34], dtype=torch.int32)
    gate_up, down = torch.randn(2, 256, 512), torch.randn(2, 256, 256)
    assert accepted_on(provider, (lhs, gate_up, sizes), {}, 1)
    assert not accepted_on(provider, (lhs, gate_up, sizes), {}, 2)  # no tp_split
    assert accepted_on(provider, (lhs, gate_up, sizes), {"tp_split": "columns"}, 2)  # 256 features a chip
    assert accepted_on(provider, (lhs, down, sizes), {"tp_split": "rows"}, 2)  # 128 input features a chip
    assert not accepted_on(provider, (lhs, down, sizes), {"tp_split": "rows"}, 3)  # 256 features do not split


def run_over_two_chips(op: str) -> dict:
    """``mesh_split.HEADS`` (how the provider wraps its kernel on a mesh) around the op's
    reference on two virtual CPU chips, each with its share of the heads (and of the KV heads,
    or the one KV head whole), against the reference on the whole arrays. (Pallas's TPU
    interpret mode cannot run across several devices of one process, so the kernel itself is
    checked per chip by the cases above.)"""
    import functools
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax
    from tpu_executor.kernels.mesh_split import HEADS

    module, env = ops_module(op), torchax_env()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    checked = {"split pages": 0, "one replicated KV head": 0}
    for case in generated_cases(module.SPEC, seed=7):
        kind = "one replicated KV head" if case.args[1].shape[0] == 1 else "split pages"
        if HEADS.problem(2, case.args, case.kwargs) is not None or checked[kind] == 3:
            continue

        def reference(*arrays):
            with env:
                return interop.jax_view(module.SPEC.reference(*interop.torch_view(arrays), **case.kwargs))

        split = HEADS.wrap(functools.partial(reference), mesh, case.args, case.kwargs)
        with jax.enable_x64(True):
            got = jax_to_torch(jax.jit(split)(*[torch_to_jax(a) for a in case.args]))
        module.SPEC.assert_close(got, case.run(module.SPEC.reference), case.label)
        checked[kind] += 1
        if min(checked.values()) == 3:
            break
    return checked


@pytest.mark.slow  # JAX over virtual devices, in a fresh interpreter
@pytest.mark.parametrize("op", ["paged_attention", "prefill_attention"])
def test_attention_split_over_the_heads_of_two_chips_matches_reference(op):
    assert in_fresh_process(run_over_two_chips, op) == {"split pages": 3, "one replicated KV head": 3}


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


def run_gmm_over_two_chips() -> dict:
    """``mesh_split.EXPERT_WEIGHTS`` around gmm's reference on two virtual CPU chips, in both
    forms (weights split by output features; by input features, partial sums added), against
    the reference on the whole arrays: {"checked": calls, "refused": calls it refused}."""
    import functools
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax
    from tpu_executor.kernels.mesh_split import EXPERT_WEIGHTS

    module, env = ops_module("gmm"), torchax_env()
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    checked, refused = 0, []
    for case in list(generated_cases(module.SPEC, seed=7))[:8]:
        for split in ("columns", "rows"):
            kwargs = dict(case.kwargs, tp_split=split)
            if EXPERT_WEIGHTS.problem(2, case.args, kwargs) is not None:
                refused.append(EXPERT_WEIGHTS.problem(2, case.args, kwargs))
                continue

            def reference(*arrays):
                with env:
                    return interop.jax_view(module.SPEC.reference(*interop.torch_view(arrays), **case.kwargs))

            wrapped = EXPERT_WEIGHTS.wrap(functools.partial(reference), mesh, case.args, kwargs)
            got = jax_to_torch(jax.jit(wrapped)(*[torch_to_jax(a) for a in case.args]))
            module.SPEC.assert_close(got, case.run(module.SPEC.reference), f"{split}: {case.label}")
            checked += 1
    return {"checked": checked, "refused": refused}


@pytest.mark.slow  # JAX over virtual devices, in a fresh interpreter
def test_gmm_split_over_the_experts_of_two_chips_matches_reference():
    """Every case both ways, INT8 experts included, but packed INT4 experts by their input
    features (a byte's two halves would part)."""
    found = in_fresh_process(run_gmm_over_two_chips)
    assert found["checked"] >= 10 and found["checked"] + len(found["refused"]) == 16, found
    assert all("packed INT4" in reason for reason in found["refused"]), found


def test_quantized_linears_on_a_mesh_need_the_split_of_their_weights():
    """Per chip only when the caller says how the weights are split, they split evenly, and a
    split by input features neither parts packed INT4 bytes nor a token's row of W8A8."""
    provider = jax_provider("w8a16_matmul")
    x, weight, scale = torch.randn(8, 256), torch.zeros(256, 512, dtype=torch.int8), torch.ones(512)
    assert not accepted_on(provider, (x, weight, scale), {}, 2)  # no tp_split
    assert accepted_on(provider, (x, weight, scale), {"tp_split": "columns"}, 2)
    assert accepted_on(provider, (x, weight, scale), {"tp_split": "rows"}, 2)
    assert not accepted_on(provider, (x, weight, scale), {"tp_split": "columns"}, 5)
    packed, groups = torch.zeros(128, 512, dtype=torch.int8), torch.ones(2, 512)
    int4, w8a8 = jax_provider("w4a16_matmul"), jax_provider("w8a8_matmul")
    assert accepted_on(int4, (x, packed, groups), {"tp_split": "columns"}, 2)
    assert not accepted_on(int4, (x, packed, groups), {"tp_split": "rows"}, 2)
    assert accepted_on(w8a8, (x, weight, scale), {"tp_split": "columns"}, 2)
    assert not accepted_on(w8a8, (x, weight, scale), {"tp_split": "rows"}, 2)  # a token's scale: its whole row


def run_linears_over_two_chips() -> dict:
    """``mesh_split.LINEAR_WEIGHTS`` around each quantized matmul's reference on two virtual
    CPU chips, weights split by columns and (INT8) by rows, against the reference on the whole
    arrays: {op: cases checked}."""
    import functools
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from torchax import interop

    from tpu_executor.kernels.binding import jax_to_torch, torch_to_jax
    from tpu_executor.kernels.mesh_split import LINEAR_WEIGHTS, TOKEN_QUANTIZED_LINEAR_WEIGHTS

    env, checked = torchax_env(), {}
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    for op in ("w8a16_matmul", "w4a16_matmul", "w8a8_matmul"):
        module, checked[op] = ops_module(op), 0
        split_over = TOKEN_QUANTIZED_LINEAR_WEIGHTS if op == "w8a8_matmul" else LINEAR_WEIGHTS
        for case in list(generated_cases(module.SPEC, seed=7))[:6]:
            for split in ("columns", "rows"):
                kwargs = dict(case.kwargs, tp_split=split)
                if split_over.problem(2, case.args, kwargs) is not None:
                    continue

                def reference(*arrays):
                    with env:
                        return interop.jax_view(module.SPEC.reference(*interop.torch_view(arrays), **case.kwargs))

                wrapped = split_over.wrap(functools.partial(reference), mesh, case.args, kwargs)
                got = jax_to_torch(jax.jit(wrapped)(*[torch_to_jax(a) for a in case.args]))
                module.SPEC.assert_close(got, case.run(module.SPEC.reference), f"{split}: {case.label}")
                checked[op] += 1
    return checked


@pytest.mark.slow  # JAX over virtual devices, in a fresh interpreter
def test_quantized_linears_split_over_two_chips_match_the_references():
    checked = in_fresh_process(run_linears_over_two_chips)
    assert checked["w4a16_matmul"] >= 4 and checked["w8a16_matmul"] >= 8 and checked["w8a8_matmul"] >= 4, checked
