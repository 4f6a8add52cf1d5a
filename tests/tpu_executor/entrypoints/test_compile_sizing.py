"""The KV cache ``tpu-executor compile`` sizes holds: over more chips than the model has KV heads
every graph keeps its Pallas kernels (each chip holds the KV head its query heads read, not a
replica of every head that a reference would gather), and a graph that finds no room beside the
probed cache shrinks it, says so, and the job goes on."""
import os

import pytest

from tests.pallas_kernels.kernel_cases import in_fresh_process


def replicated_heads_job(root: str) -> dict:
    """A model of 8 query heads and 2 KV heads compiled for v6e-8 (tp = 8), model steps only."""
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import compile_job
    from tpu_executor.tools.random_checkpoint import TPU_TINY, write_config

    checkpoint = write_config(os.path.join(root, "qwen3"), "qwen3", dict(TPU_TINY, num_key_value_heads=2))
    options = dict(max_model_len=256, max_num_seqs=8, prefill_buckets=(64, 128), decode_buckets=(8,),
                   decode_context_buckets=(256,), max_logprobs=0, cache_dir=None)
    report = compile_job(checkpoint, Target.parse("v6e-8"), options, show_progress=False, model_steps_only=True)
    return {"fits": report.fits, "warnings": report.kernel_warnings, "resized": report.resized,
            "kernels": {g.name: list(g.pallas_kernels) for g in report.graphs}, "block": report.block_bytes,
            "blocks": report.num_blocks, "resident": report.resident_bytes, "usable": report.usable_bytes,
            "copies": report.weight_copies, "layers": TPU_TINY["num_hidden_layers"],
            "peaks": [g.peak for g in report.graphs]}


@pytest.mark.slow  # libtpu compiles a small plan over 8 chips (about two minutes)
def test_more_chips_than_kv_heads_keep_the_pallas_kernels_and_one_head_a_chip(tmp_path):
    job = in_fresh_process(replicated_heads_job, str(tmp_path))
    assert job["fits"] and job["warnings"] == [] and job["copies"] == [] and job["resized"] == ""
    assert {name.split()[0] for name in job["kernels"]} == {"prefill", "decode"} and len(job["kernels"]) == 3
    for name, kernels in job["kernels"].items():  # "prefill tokens=64 keys=192" fell back to the reference
        assert kernels == (["prefill_attention"] if name.startswith("prefill") else ["paged_attention"]), name
    # A block on one chip: K and V of every layer, one KV head (2 heads, each held by 4 chips).
    assert job["block"] == 2 * job["layers"] * 1 * 16 * 128 * 2
    # The cache takes what the binding graph leaves, to within 0.1% of the HBM (probes close
    # together left 5% over: the compiler's alignment of small buffers steepened their line).
    assert job["resident"] < max(job["peaks"]) <= job["usable"] < 1.001 * max(job["peaks"])


class OutOfHbmWorker:
    """A worker whose ``label`` graph runs out of HBM beside more than ``room`` blocks."""

    def __init__(self, label: str, room: int):
        self.label, self.room, self.compiled_over = label, room, []

    def compile_plan(self, num_blocks, max_model_len, show_progress=True, graphs=None):
        from tpu_executor.worker.jax.graphs import GraphCompileError

        self.compiled_over.append(num_blocks)
        if num_blocks > self.room:
            raise GraphCompileError(f"compiling {self.label} failed: XlaRuntimeError: RESOURCE_EXHAUSTED: "
                                    "Ran out of memory in memory space hbm.", self.label)
        return ["records"]


def sizing_report(root: str, **options):
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_figures import CompileReport
    from tpu_executor.entrypoints.compile_job import engine_config
    from tpu_executor.tools.random_checkpoint import write_config

    target = Target.parse("v5e-1")
    config = engine_config(write_config(os.path.join(root, "llama"), "llama"), target, dict(
        max_model_len=256, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
        decode_context_buckets=(256,), max_logprobs=0, cache_dir=None, **options))
    return CompileReport(target, "libtpu", config, weight_bytes=1 << 20, block_bytes=1 << 16,
                         usable_bytes=1 << 30, num_blocks=options.get("num_blocks", 1000), max_model_len=256)


def test_a_graph_out_of_hbm_beside_the_probed_cache_shrinks_it_and_says_so(tmp_path, monkeypatch):
    from tpu_executor.entrypoints import compile_fit

    probed = []

    def blocks_beside(report, worker, graphs, show_progress):
        probed.extend(graphs)
        return "sample rows=8", 600

    monkeypatch.setattr(compile_fit, "_blocks_beside_graphs", blocks_beside)
    monkeypatch.setattr(compile_fit, "_over_usable", lambda report, worker, records: ("decode", 0))
    report = sizing_report(str(tmp_path))
    label = next(name for name in map(compile_fit.graph_label, compile_fit.BucketPlan.from_config(
        report.config).graphs()) if name.startswith("sample"))
    worker = OutOfHbmWorker(label, room=600)
    records, job = compile_fit.compile_fitting(report, worker, model_steps_only=False, show_progress=False)
    assert records == ["records"] and job is None and worker.compiled_over == [1000, 600]
    assert [compile_fit.graph_label(g) for g in probed] == [label]  # the graph that failed, probed alone
    assert report.num_blocks == 600 and "the cache shrank to the 600 blocks" in report.resized

    # Shrunk once, and still out of HBM: refused, naming what to change.
    with pytest.raises(compile_fit.DoesNotFit, match="To fit"):
        compile_fit.compile_fitting(sizing_report(str(tmp_path)), OutOfHbmWorker(label, room=10), False, False)
    # A cache the user sized is theirs: the job is refused rather than resized.
    with pytest.raises(compile_fit.DoesNotFit, match="RESOURCE_EXHAUSTED"):
        compile_fit.compile_fitting(sizing_report(str(tmp_path), num_blocks=1000), worker, False, False)


def test_a_graph_that_compiles_but_peaks_over_the_usable_hbm_shrinks_the_cache_by_its_excess(tmp_path, monkeypatch):
    """A graph without the cache among its inputs (prompt log-probs, a sampler) is not among the
    probes' line; one that peaks over the usable HBM costs the cache its excess in blocks."""
    from tpu_executor.entrypoints import compile_fit

    report = sizing_report(str(tmp_path))
    excess = iter([10 * report.block_bytes - 5, 0])
    monkeypatch.setattr(compile_fit, "_over_usable", lambda report, worker, records: ("prompt log-probs", next(excess)))
    worker = OutOfHbmWorker("none", room=10 ** 6)
    records, _ = compile_fit.compile_fitting(report, worker, model_steps_only=False, show_progress=False)
    assert worker.compiled_over == [1000, 990] and report.num_blocks == 990
    assert report.resized.startswith("graph 'prompt log-probs' peaked") and "shrank to 990 blocks" in report.resized
