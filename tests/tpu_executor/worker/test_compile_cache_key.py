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


def test_adapter_slots_and_speculation_change_the_keys(checkpoints):
    """LoRA slots (inputs of every model graph) and speculation shape the programs: the compile
    cache's key and an ahead-of-time job's parts differ with them."""
    from tpu_executor.engine.options import build_engine_config
    from tpu_executor.worker.jax.aot import engine_parts
    from tpu_executor.worker.worker import Worker

    path = checkpoints["llama"]
    configs = [build_engine_config(path, device="jax"), build_engine_config(path, device="jax", enable_lora=True),
               build_engine_config(path, device="jax", enable_lora=True, max_loras=4),
               build_engine_config(path, device="jax", speculative_config={"method": "ngram"})]
    assert len({Worker(config)._compile_cache_key("kernels") for config in configs}) == len(configs)
    assert len({repr(engine_parts(config)) for config in configs}) == len(configs)
