"""The compile caches' one key (``worker/jax/aot.py``: an ahead-of-time job's, the JAX path's
persistent cache's, torch_xla's): what steers the traced programs or the compiler is in it, so a
change never loads an executable built under other settings; where a checkpoint lies is not."""
import json
import os
import shutil

from tpu_executor.engine.options import build_engine_config
from tpu_executor.worker.jax.aot import cache_parts, engine_parts, job_key
from tpu_executor.worker.jax.runtime import target_parts

CPU = {"platform": "cpu", "device_kind": "cpu", "devices": "1", "partitioner": "shardy", "xla_flags": ""}


def key_of(config, target=None) -> str:
    return job_key(cache_parts(config, CPU if target is None else target, "kernels"))


def test_the_tpu_key_follows_xla_flags_and_libtpu_init_args_but_not_dump_options(checkpoints, monkeypatch):
    config = build_engine_config(checkpoints["llama"], device="jax")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)

    def tpu_key() -> str:
        return key_of(config, target_parts("tpu", "TPU v6 lite", 8, "gspmd"))

    plain = tpu_key()
    assert tpu_key() == plain
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/graphs --xla_dump_hlo_as_text")
    assert tpu_key() == plain  # reading what the compiler did must not miss the executables
    monkeypatch.setenv("XLA_FLAGS", "--xla_tpu_enable_latency_hiding_scheduler=false")
    flagged = tpu_key()
    assert flagged != plain
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_enable_async_collective_fusion=false")
    assert tpu_key() not in (plain, flagged)


def test_adapter_slots_and_speculation_change_the_key(checkpoints):
    """LoRA slots (inputs of every model graph) and speculation shape the programs."""
    path = checkpoints["llama"]
    configs = [build_engine_config(path, device="jax"), build_engine_config(path, device="jax", enable_lora=True),
               build_engine_config(path, device="jax", enable_lora=True, max_loras=4),
               build_engine_config(path, device="jax", speculative_config={"method": "ngram"})]
    assert len({key_of(config) for config in configs}) == len(configs)
    assert len({repr(engine_parts(config)) for config in configs}) == len(configs)


def draft_engine(target: str, draft: str, method: str = "draft_model"):
    return build_engine_config(target, device="jax", speculative_config={
        "method": method, "model": draft, "num_speculative_tokens": 2})


def test_the_key_holds_the_draft_checkpoints_config_not_its_path(checkpoints, tmp_path):
    """A new draft at the same path is another key (its graphs have other shapes); the same
    draft at another path is the same key."""
    target, draft = checkpoints["llama"], str(tmp_path / "draft")
    shutil.copytree(checkpoints["llama"], draft)
    before = key_of(draft_engine(target, draft))
    shutil.copytree(draft, str(tmp_path / "moved"))
    assert key_of(draft_engine(target, str(tmp_path / "moved"))) == before
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(dict(config, num_hidden_layers=1), f)
    after = key_of(draft_engine(target, draft))
    assert after != before


def test_the_key_holds_the_eagle3_heads_config(checkpoints, tmp_path):
    from tpu_executor.tools.eagle3_head import write_random_eagle3_head

    target = checkpoints["llama"]
    head = write_random_eagle3_head(target, str(tmp_path / "head"))
    before = key_of(draft_engine(target, head, "eagle3"))
    shutil.rmtree(head)
    write_random_eagle3_head(target, head, draft_vocab_size=300)  # another head at the same path
    assert key_of(draft_engine(target, head, "eagle3")) != before


def test_the_engine_uses_that_key_for_the_jax_paths_persistent_cache(checkpoints, tmp_path, monkeypatch):
    """The JAX path's start keys its persistent cache with the builder the compile command uses."""
    from tpu_executor.worker.jax.aot import job_parts
    from tpu_executor.worker.worker import Worker

    config = build_engine_config(checkpoints["llama"], device="jax", cache_dir=str(tmp_path))
    worker = Worker(config)
    used = []
    worker.jax = type("Runtime", (), {"target": CPU, "use_compile_cache": lambda self, root, key: used.append(key)})()
    worker._use_jax_caches(str(tmp_path), "kernels")
    assert used == [job_key(job_parts(config, worker.jax, "kernels"))] == [key_of(config)]
