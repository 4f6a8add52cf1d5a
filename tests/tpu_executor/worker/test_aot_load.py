"""Executables compiled ahead of time are found and loaded by the engine that runs them: the
compile-and-store code of ``tpu-executor compile``, run for this machine's CPU, writes a job
that a fresh process loads with zero compilations and the same tokens; a job of another
libtpu, chip, topology or plan is never loaded, and the line saying so names what differs; a
file of a job whose bytes are not those its manifest names is refused before it is unpickled.
(Loading on a TPU is the same code with the TPU's client; only a TPU can run it.)"""
import hashlib
import json
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from tests.pallas_kernels.kernel_cases import in_fresh_process
from tpu_executor.worker.jax import programs
from tpu_executor.worker.jax.aot import AotJob, differences

OPTIONS = dict(max_model_len=320, max_num_seqs=8, prefill_buckets=(32, 128, 320), decode_buckets=(2, 8),
               decode_context_buckets=(128, 320), num_blocks=256)
PARTS = {"model_config": "{}", "dtype": "'bfloat16'", "platform": "tpu", "device_kind": "TPU v6 lite", "devices": "8",
         "libtpu": "0.0.21", "libtpu_init_args": ""}


def written_job(cache_dir: str, files=None) -> AotJob:
    """A job of ``PARTS`` whose compile kept ``files`` ({folder: {key: bytes}}), its manifest written."""
    job = AotJob.create(cache_dir, PARTS, num_blocks=100, max_model_len=4096, target="v6e-8")
    runtime = SimpleNamespace()
    job.attach(runtime, writes=True)
    stores = {"programs": runtime.programs, "executables": runtime.executables}
    for folder, records in (files or {}).items():
        for key, data in records.items():
            stores[folder].write(key, data)
    job.write_manifest(runtime)
    return job


def test_a_job_is_found_only_by_exactly_its_parts(tmp_path, caplog):
    written_job(str(tmp_path))
    found = AotJob.find(str(tmp_path), dict(PARTS))
    assert (found.num_blocks, found.max_model_len, found.target) == (100, 4096, "v6e-8")
    with caplog.at_level(logging.WARNING):
        assert AotJob.find(str(tmp_path), dict(PARTS, libtpu="0.0.24", device_kind="TPU v5 lite")) is None
    line = caplog.records[-1].getMessage()
    assert "libtpu differs (compiled: 0.0.21, here: 0.0.24)" in line and "device_kind differs" in line
    assert "dtype" not in line


def test_a_job_without_its_manifest_is_never_found(tmp_path):
    AotJob.create(str(tmp_path), PARTS, num_blocks=100, max_model_len=4096, target="v6e-8")  # compile died
    assert AotJob.find(str(tmp_path), dict(PARTS)) is None
    assert differences({"a": "1"}, {"a": "1", "b": "2"}) == ["b differs (compiled: absent, here: 2)"]


GENUINE = pickle.dumps(("payload", "in tree", "out tree"))


@pytest.fixture
def no_unpickling(monkeypatch):
    """Fail the test if anything of a job is unpickled or deserialized."""
    def refuse(*args, **kwargs):
        raise AssertionError("a job's file was unpickled")

    from jax.experimental import serialize_executable

    monkeypatch.setattr(programs.pickle, "loads", refuse)
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", refuse)


def loaded_job(cache_dir: str):
    """A runtime with the job of ``PARTS`` in ``cache_dir`` attached, as an engine start finds it."""
    runtime = SimpleNamespace()
    AotJob.find(cache_dir, dict(PARTS)).attach(runtime)
    return runtime


def test_the_manifest_holds_each_files_sha256_and_a_genuine_executable_loads(tmp_path, monkeypatch):
    from jax.experimental import serialize_executable

    job = written_job(str(tmp_path), {"executables": {"k1": GENUINE}})
    assert AotJob.find(str(tmp_path), dict(PARTS)).sha256 == {
        "programs": {}, "executables": {"k1": hashlib.sha256(GENUINE).hexdigest()}}
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", lambda *payload: payload)
    assert loaded_job(str(tmp_path)).executables.load("k1") == ("payload", "in tree", "out tree")
    with open(os.path.join(job.path, "executables", "k2"), "wb") as f:  # a file the manifest does not name
        f.write(GENUINE)
    assert loaded_job(str(tmp_path)).executables.load("k2") is None


@pytest.mark.parametrize("folder", ["executables", "programs"])
def test_a_tampered_file_is_refused_naming_it_and_never_unpickled(tmp_path, folder, no_unpickling):
    job = written_job(str(tmp_path), {folder: {"k1": GENUINE}})
    path = os.path.join(job.path, folder, "k1")
    with open(path, "wb") as f:
        f.write(pickle.dumps(("payload", "in tree", "another tree")))
    runtime = loaded_job(str(tmp_path))
    store = runtime.executables if folder == "executables" else runtime.programs
    with pytest.raises(ValueError, match=f"{path} is not the file its job's manifest names"):
        store.load("k1")
    store.save("k1", None)  # a job read back is never written into
    assert os.path.getsize(path) != len(GENUINE)


def compile_for_this_cpu(checkpoint: str, cache_dir: str, options=None):
    """``compile_job`` of ``options`` with this process's CPU device in place of a slice's chips."""
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import compile_job
    from tpu_executor.worker.jax.runtime import cpu_runtime

    cpu_runtime()
    import jax

    report = compile_job(checkpoint, Target.parse("v5e-1"), dict(options or OPTIONS, cache_dir=cache_dir),
                         show_progress=False, devices=jax.devices("cpu"))
    return report.fits, report.job_path, len(report.graphs), report.config.model.dtype


LOAD = textwrap.dedent("""
    import json, sys
    from tpu_executor import LLM, SamplingParams
    from tpu_executor.core.buckets import BucketPlan
    options = json.loads(sys.argv[1])
    llm = LLM(model=sys.argv[2], device="jax", show_progress=False, strict=True, **options)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": list(range(3, 90))}],
                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stats = llm.stats()
    print(json.dumps({"compiled": stats.graphs_compiled_at_warmup, "after": stats.graphs_compiled_after_warmup,
                      "loaded": stats.compile_cache_hits,
                      "planned": len(BucketPlan.from_config(llm.engine.config).graphs()),
                      "tokens": [o.outputs[0].token_ids for o in out]}))
""")


def start_fresh(checkpoint: str, **options) -> dict:
    result = subprocess.run([sys.executable, "-c", LOAD, json.dumps(options), checkpoint], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]), log=result.stderr)


@pytest.mark.slow  # a plan compiled, then two engines started in fresh processes
def test_a_fresh_process_loads_the_compiled_job_and_compiles_nothing(checkpoints, tmp_path):
    checkpoint, cache_dir = checkpoints["llama"], str(tmp_path / "aot")
    fits, job_path, graphs, dtype = in_fresh_process(compile_for_this_cpu, checkpoint, cache_dir)
    assert fits and dtype == "float32" and os.path.isfile(os.path.join(job_path, "manifest.json"))
    assert len(os.listdir(os.path.join(job_path, "executables"))) == graphs

    loaded = start_fresh(checkpoint, cache_dir=cache_dir, **OPTIONS)
    assert (loaded["compiled"], loaded["after"], loaded["loaded"]) == (0, 0, graphs), loaded["log"][-2000:]
    assert all(len(set(t)) > 3 for t in loaded["tokens"])  # context-dependent, not one repeated token

    # Another plan misses, says why, and compiles here: greedy tokens do not depend on the buckets.
    other_plan = start_fresh(checkpoint, cache_dir=cache_dir, **dict(OPTIONS, decode_buckets=[4, 8]))
    assert other_plan["compiled"] == other_plan["planned"] and other_plan["tokens"] == loaded["tokens"]
    assert "decode_buckets differs (compiled: (2, 8), here: (4, 8))" in other_plan["log"]


@pytest.mark.slow  # a plan with a draft model's graphs compiled, then an engine started in a fresh process
def test_the_draft_models_executables_are_kept_in_the_job_and_loaded(checkpoints, tmp_path):
    checkpoint, cache_dir = checkpoints["llama"], str(tmp_path / "aot")
    options = dict(OPTIONS, speculative_config={"method": "draft_model", "model": checkpoint,
                                                "num_speculative_tokens": 2})
    fits, job_path, graphs, _ = in_fresh_process(compile_for_this_cpu, checkpoint, cache_dir, options)
    assert fits and len(os.listdir(os.path.join(job_path, "executables"))) == graphs
    with open(os.path.join(job_path, "manifest.json")) as f:
        assert len(json.load(f)["sha256"]["executables"]) == graphs

    loaded = start_fresh(checkpoint, cache_dir=cache_dir, **options)
    assert (loaded["compiled"], loaded["after"], loaded["loaded"]) == (0, 0, graphs), loaded["log"][-2000:]
