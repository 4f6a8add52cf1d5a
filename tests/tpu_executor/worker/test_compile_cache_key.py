"""The JAX path's compile-cache key: what steers the traced programs or XLA's compiler is in it,
so a change never loads an executable built under other settings."""
from tpu_executor.worker.jax.runtime import compile_cache_key


def test_the_key_follows_the_engine_parts_and_xla_flags(checkpoints, monkeypatch):
    path = checkpoints["llama"]
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    plain = compile_cache_key(("plan-a", "kernels-a"), path)
    assert compile_cache_key(("plan-a", "kernels-a"), path) == plain
    assert compile_cache_key(("plan-b", "kernels-a"), path) != plain
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=true")
    assert compile_cache_key(("plan-a", "kernels-a"), path) != plain
