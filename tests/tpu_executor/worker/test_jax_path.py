"""The JAX path (torchax + jax.jit): its persistent compile cache (a second start traces and
compiles nothing; a changed kernel source misses; a corrupt entry is traced and compiled again
with a warning), SPMD tensor parallelism over virtual CPU devices equal to one device, and its
configuration errors. Greedy parity per architecture is in tests/models/test_parity.py."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.common import greedy_tokens, mixed_prompts, tiny_engine_options
from tpu_executor import LLM
from tpu_executor.core.buckets import BucketPlan
from tpu_executor.engine.stats import startup_report

pytestmark = pytest.mark.slow  # XLA compilation

PROMPTS = mixed_prompts(4, 16, 200, vocab=500)
# One bucket of each kind: these tests are about caching and splitting graphs, not the plan.
ONE_BUCKET_EACH = dict(prefill_buckets=(320,), decode_buckets=(8,), decode_context_buckets=(320,))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start(path, cache_dir, **overrides):
    """An engine on the JAX path with its compile cache under ``cache_dir``, and its tokens."""
    options = tiny_engine_options(strict=True, cache_dir=str(cache_dir), **{**ONE_BUCKET_EACH, **overrides})
    llm = LLM(model=path, device="jax", **options)
    return llm, greedy_tokens(llm, PROMPTS, 24)


def planned(llm) -> int:
    return len(BucketPlan.from_config(llm.engine.config).graphs())


def test_second_start_compiles_nothing_and_changes_miss(checkpoints, tmp_path, monkeypatch):
    """A cold start compiles the plan, a warm one reads every program and executable back; a
    changed kernel source misses (a changed plan misses naming what differs: test_aot_load.py);
    a corrupt entry is traced and compiled again with a warning."""
    import jax
    from torch_xla._internal.jax_workarounds import maybe_get_jax

    # torch_xla's call_jax turns JAX's Shardy partitioner off process-wide (as every XLA-path
    # kernel call in this suite does): the JAX path still exports and compiles for Shardy.
    maybe_get_jax()
    assert not jax.config.jax_use_shardy_partitioner
    path = checkpoints["llama"]
    cold, cold_tokens = start(path, tmp_path)
    stats = cold.stats()
    assert stats.graphs_compiled_at_warmup == planned(cold) and stats.compile_cache_hits == 0
    assert stats.compile_cache_misses >= planned(cold) and stats.compile_seconds > 0
    report = startup_report(cold.engine.config, stats, 1.0)
    assert "(cold start)" in report
    kernels = dict(stats.kernel_providers)  # the report's last line names each op's provider
    assert "paged_attention" in kernels and f"paged_attention={kernels['paged_attention']}" in report.splitlines()[-1]
    cold.shutdown()

    from tpu_executor.worker.jax.graphs import JaxFunction

    with monkeypatch.context() as patched:  # a warm start reads every traced program back
        patched.setattr(JaxFunction, "_trace", lambda *_: pytest.fail("a warm start traced a graph"))
        warm, warm_tokens = start(path, tmp_path)
    stats = warm.stats()
    assert stats.graphs_compiled_at_warmup == 0 and stats.compile_cache_hits == planned(warm)
    assert warm_tokens == cold_tokens and all(len(set(t)) > 4 for t in warm_tokens)
    assert "(warm start)" in startup_report(warm.engine.config, stats, 1.0)
    assert warm.stats().graphs_compiled_after_warmup == 0
    warm.shutdown()

    from tpu_executor.kernels.registry import OpRegistry

    with monkeypatch.context() as patched:
        patched.setattr(OpRegistry, "fingerprint", lambda self, jax_path=False: "a-changed-kernel-source")
        other_kernels, _ = start(path, tmp_path)
    assert other_kernels.stats().compile_cache_hits == 0
    assert len(os.listdir(tmp_path)) == 2  # one directory per (model, config, plan, kernels, versions)
    other_kernels.shutdown()

    assert_a_corrupt_cache_is_compiled_again(path, tmp_path, cold_tokens)


def assert_a_corrupt_cache_is_compiled_again(path, cache_dir, expected) -> None:
    """Every entry under ``cache_dir`` overwritten: the next start warns, compiles its plan
    again and gives ``expected``."""
    entries = [os.path.join(root, name) for root, _, names in os.walk(cache_dir) for name in names]
    for entry in entries:
        with open(entry, "wb") as f:
            f.write(b"not an executable")
    with pytest.warns(UserWarning) as warned:
        again, tokens = start(path, cache_dir)
    messages = " ".join(str(w.message) for w in warned)
    assert "cannot be read" in messages and "persistent compilation cache" in messages
    assert tokens == expected
    assert again.stats().graphs_compiled_at_warmup == planned(again)
    again.shutdown()


SPMD_RUN = textwrap.dedent("""
    import json, sys
    from tests.common import greedy_tokens, mixed_prompts, tiny_engine_options
    from tpu_executor import LLM
    path, result = sys.argv[1], {}
    for tp in (1, 2, 4):
        llm = LLM(model=path, device="jax", tensor_parallel_size=tp, **tiny_engine_options(
            strict=True, prefill_buckets=(320,), decode_buckets=(8,), decode_context_buckets=(320,)))
        tokens = greedy_tokens(llm, mixed_prompts(4, 16, 200, vocab=500), 24)
        model = llm.engine.core.executor.workers[0].model
        layer = model.model.layers[0]
        mlp = layer.mlp.experts.w13 if hasattr(layer.mlp, "experts") else layer.mlp.gate_up_proj.weight
        shardings = [list(t.jax().sharding.spec) for t in (layer.self_attn.o_proj.weight, mlp,
                                                           model.model.embed_tokens.weight)]
        runner = llm.engine.core.executor.workers[0].runner
        texts = [executable.as_text() for executable, _ in runner._decode_fn.executables.values()]
        result[tp] = dict(tokens=tokens, shardings=shardings, all_reduce=all("all-reduce" in t for t in texts),
                          after=llm.stats().graphs_compiled_after_warmup)
        llm.shutdown()
    print(json.dumps(result))
""")


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_spmd_tensor_parallel_equals_one_device(checkpoints, arch):
    """tp = 2 and 4 over virtual CPU devices: the same greedy tokens as tp = 1, weights split as
    Megatron places them (row-parallel over input features, column-parallel and experts over
    output features, the embedding over the vocabulary), all-reduces inside the compiled step.
    Qwen3-MoE has every split a dense model has and the experts' too; a dense Llama runs SPMD
    across two hosts in ``executor/test_multihost.py``."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    result = subprocess.run([sys.executable, "-c", SPMD_RUN, checkpoints[arch]], env=env, capture_output=True,
                            text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs["2"]["tokens"] == runs["4"]["tokens"] == runs["1"]["tokens"]
    assert all(len(set(t)) > 4 for t in runs["1"]["tokens"])
    assert runs["1"]["shardings"] == [[]] * 3  # each dimension's mesh axis (None: not split)
    split = [["tp", None], [None, None, "tp"] if arch == "qwen3_moe" else [None, "tp"], ["tp", None]]
    assert runs["2"]["shardings"] == runs["4"]["shardings"] == split
    assert runs["2"]["all_reduce"] and runs["4"]["all_reduce"] and not runs["1"]["all_reduce"]
    assert all(run["after"] == 0 for run in runs.values())


SPMD_SPECULATIVE_RUN = textwrap.dedent("""
    import json, sys
    from tests.common import greedy_tokens, mixed_prompts, tiny_engine_options
    from tpu_executor import LLM
    from tpu_executor.tools.eagle3_head import write_random_eagle3_head
    path, head_dir, result = sys.argv[1], sys.argv[2], {}
    drafts = {"plain": None, "draft_model": path, "eagle3": write_random_eagle3_head(path, head_dir)}
    for method, draft in drafts.items():
        config = {"method": method, "model": draft, "num_speculative_tokens": 3} if draft else None
        llm = LLM(model=path, device="jax", tensor_parallel_size=2, speculative_config=config,
                  **tiny_engine_options(strict=True, prefill_buckets=(320,), decode_buckets=(8,),
                                        decode_context_buckets=(320,)))
        tokens = greedy_tokens(llm, mixed_prompts(4, 16, 200, vocab=500), 24)
        stats = llm.stats()
        drafted = stats.spec_decode.num_draft_tokens if config else 0
        result[method] = dict(tokens=tokens, drafted=drafted, after=stats.graphs_compiled_after_warmup)
        llm.shutdown()
    print(json.dumps(result))
""")


def test_spmd_drafters_at_tp2_equal_the_plain_engine(checkpoints, tmp_path):
    """A draft model (the target itself) and an EAGLE-3 head split with the target over two
    virtual CPU devices: the plain engine's greedy tokens at tp = 2, drafts made, nothing
    compiled after warm-up."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    result = subprocess.run([sys.executable, "-c", SPMD_SPECULATIVE_RUN, checkpoints["llama"], str(tmp_path / "head")],
                            env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs["draft_model"]["tokens"] == runs["eagle3"]["tokens"] == runs["plain"]["tokens"]
    assert runs["draft_model"]["drafted"] > 0 and runs["eagle3"]["drafted"] > 0
    assert all(run["after"] == 0 for run in runs.values())


def test_configuration_errors_name_the_fix(checkpoints):
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=2"):
        LLM(model=checkpoints["llama"], device="jax", tensor_parallel_size=2, **tiny_engine_options())

