"""``tpu-executor compile``: a job compiled by libtpu for TPU slices on this CPU machine, every
architecture's graphs holding their Pallas kernels, the report's keys, the fit check (a job
refused before any compile), the kernel refusals, and ``dtype="auto"``."""
import importlib.metadata
import json
import os
import subprocess

import pytest

from tests.pallas_kernels.kernel_cases import in_fresh_process
from tpu_executor.tools.random_checkpoint import ARCHITECTURES

SMALL_PLAN = ["--max-model-len", "512", "--max-num-seqs", "8", "--prefill-buckets", "128", "--decode-buckets", "8",
              "--decode-context-buckets", "512", "--max-logprobs", "2"]
# The op each model graph must hold as a Pallas kernel; MoE layers add gmm.
MOE = ("mixtral", "qwen3_moe")


def compile_command(args, cwd, expect_ok=True):
    result = subprocess.run(["tpu-executor", "compile", *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert (result.returncode == 0) == expect_ok, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def model_graph_kernels(target_name: str, architectures, root: str, quantization=None) -> dict:
    """{architecture: {graph: Pallas ops}} for the largest prefill and decode graphs of a small
    plan, each compiled by libtpu for ``target_name`` over the slice's chips, and under
    ``"weight copies"`` the weight-sized buffers any of them allocates. ``quantization``: a
    scheme to quantize at load, or a published checkpoint's ``quantization_config``."""
    from tpu_executor.core.buckets import BucketPlan
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_fit import _largest_graphs
    from tpu_executor.entrypoints.compile_job import engine_config, shapes_worker, weight_copies
    from tpu_executor.tools.random_checkpoint import write_config
    from tpu_executor.worker.jax.target import target_devices

    target = Target.parse(target_name)
    devices = target_devices(target)
    found = {"weight copies": []}
    for arch in architectures:
        path = write_config(os.path.join(root, arch), arch)
        if isinstance(quantization, dict):
            with open(os.path.join(path, "config.json")) as f:
                hf_config = json.load(f)
            with open(os.path.join(path, "config.json"), "w") as f:
                json.dump({**hf_config, "quantization_config": quantization}, f)
        config = engine_config(path, target, dict(
            max_model_len=512, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
            decode_context_buckets=(512,), cache_dir=None,
            quantization=None if isinstance(quantization, dict) else quantization))
        worker = shapes_worker(config, devices)
        graphs = _largest_graphs(BucketPlan.from_config(config).graphs())
        records = worker.compile_plan(64, config.max_model_len, show_progress=False, graphs=graphs)
        found[arch] = {r.label: sorted({k.op for k in r.program.kernels if k.pallas}) for r in records}
        found["weight copies"] += [f"{arch} {line}" for line in weight_copies(records, worker)]
    return found


# Every architecture on one chip; over four chips (each kernel split over the chips by
# shard_map) the two that split differently: one KV head replicated, experts cut in four; over
# a v7x's eight TensorCores (four chips, both cores of each a device of the mesh). No
# graph may copy a weight: each is read in the layout it is stored in (the embedding's lookup
# and the tied LM head's matmul from one table included).
@pytest.mark.slow  # libtpu compiles 2 graphs of each architecture (about 2 minutes for all)
@pytest.mark.parametrize("target,architectures", [("v5e-1", ARCHITECTURES), ("v6e-4", ("gemma3", "qwen3_moe")),
                                                  ("tpu7x-8", ("qwen3", "qwen3_moe"))])
def test_architectures_compile_for_a_tpu_with_their_pallas_kernels(target, architectures, tmp_path):
    found = in_fresh_process(model_graph_kernels, target, architectures, str(tmp_path))
    for arch in architectures:
        moe = ["gmm"] if arch in MOE else []
        prefill, decode = found[arch]["prefill tokens=128 keys=512"], found[arch]["decode rows=8 blocks=32"]
        assert (prefill, decode) == (sorted(moe + ["prefill_attention"]), sorted(moe + ["paged_attention"])), arch
    assert found["weight copies"] == []


def state_graphs_over(target_name: str, root: str) -> list:
    """The labels of a small plan's graphs beside the model steps (the sampler's variants,
    prompt log-probs), each compiled by libtpu for ``target_name`` over the slice's chips."""
    from tpu_executor.core.buckets import BucketPlan, graph_label
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import engine_config, shapes_worker
    from tpu_executor.tools.random_checkpoint import write_config
    from tpu_executor.worker.jax.target import target_devices

    target = Target.parse(target_name)
    config = engine_config(write_config(os.path.join(root, "llama"), "llama"), target, dict(
        max_model_len=512, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
        decode_context_buckets=(512,), max_logprobs=2, cache_dir=None))
    worker = shapes_worker(config, target_devices(target))
    graphs = [g for g in BucketPlan.from_config(config).graphs()
              if not graph_label(g).startswith(("prefill", "decode"))]
    return [record.label for record in worker.compile_plan(64, config.max_model_len, show_progress=False,
                                                           graphs=graphs)]


# Over a slice's chips the sampler returns 64-bit token ids and seeds from its exported program,
# which libtpu 0.0.42.1 aborts on when the program pins their sharding (graphs.py).
@pytest.mark.slow  # libtpu compiles the sampler's and prompt log-probs' small graphs (about 30 s)
def test_the_graphs_beside_the_model_steps_compile_over_four_chips(tmp_path):
    labels = in_fresh_process(state_graphs_over, "v6e-4", str(tmp_path))
    assert any(label.startswith("sampler") for label in labels) and any("log-probs" in label for label in labels)


# A GPTQ checkpoint's config (4-bit levels with zero points in groups of 128): compiling reads
# no weights, so every layer is built for its format.
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False, "desc_act": False}


# W8A8 on one chip; a GPTQ checkpoint over four (the kernel per chip, its weights split). INT8
# and load-time INT4 run the same kernels (compiled at 8B shapes: test_quantized_matmul.py).
@pytest.mark.slow  # libtpu compiles 2 graphs of each model
@pytest.mark.parametrize("target,quantization,op", [("v5e-1", "w8a8", "w8a8_matmul"),
                                                    ("v6e-4", GPTQ_CONFIG, "w4a16_matmul")], ids=["w8a8", "gptq"])
def test_quantized_models_compile_with_their_kernels(tmp_path, target, quantization, op):
    found = in_fresh_process(model_graph_kernels, target, ("llama", "qwen3_moe"), str(tmp_path), quantization)
    for arch, moe in (("llama", []), ("qwen3_moe", ["gmm"])):  # experts: dequantized before the gmm
        assert found[arch]["decode rows=8 blocks=32"] == sorted(moe + ["paged_attention", op]), arch
        assert found[arch]["prefill tokens=128 keys=512"] == sorted(moe + ["prefill_attention", op]), arch


@pytest.mark.slow  # libtpu compiles a whole plan (about a minute)
@pytest.mark.parametrize("method", ["draft_model", "eagle3"])
def test_the_command_compiles_every_graph_and_reports_them(method, tmp_path):
    """With a draft model or an EAGLE-3 head drafting 2 tokens: the verify graphs (8
    sequences x 3 queries) and the drafter's graphs (its catch-up, its greedy steps) are
    compiled too."""
    from tpu_executor.core.buckets import BucketPlan
    from tpu_executor.core.speculative import SpeculativeConfig
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import engine_config
    from tpu_executor.tools.eagle3_head import write_random_eagle3_head
    from tpu_executor.tools.random_checkpoint import write_config

    checkpoint = write_config(str(tmp_path / "llama"), "llama")
    draft = checkpoint if method == "draft_model" else write_random_eagle3_head(checkpoint, str(tmp_path / "head"))
    speculative = json.dumps({"method": method, "model": draft, "num_speculative_tokens": 2})
    out = compile_command([checkpoint, "--target", "v5e-1", "--cache-dir", str(tmp_path / "aot"), "--json",
                           str(tmp_path / "report.json"), *SMALL_PLAN, "--speculative-config", speculative],
                          tmp_path).stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert {"target", "libtpu", "fits", "hbm_per_chip_bytes", "peak_bytes_per_chip", "kv_cache_blocks",
            "graphs"} <= set(report)
    assert (report["target"], report["libtpu"], report["fits"]) == ("v5e-1", importlib.metadata.version("libtpu"), True)
    # one graph at a time: two at once crash libtpu (model_runner.compile_threads)
    assert report["compile_threads"] == 1 and "1 graph(s) at a time" in out
    config = engine_config(checkpoint, Target.parse("v5e-1"), dict(
        max_model_len=512, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
        decode_context_buckets=(512,), max_logprobs=2, speculative_config=SpeculativeConfig.parse(speculative)))
    assert len(report["graphs"]) == len(BucketPlan.from_config(config).graphs())
    assert {"decode rows=8 blocks=32", "verify rows=8 queries=3 blocks=32",
            "draft catch-up prefill tokens=128 keys=256", "draft catch-up decode rows=24 blocks=32",
            "draft steps decode rows=8 blocks=32"} <= {
        graph["name"] for graph in report["graphs"]}
    for graph in report["graphs"]:
        assert set(graph) >= {"name", "compile_seconds", "hbm", "flops", "bytes_accessed", "hbm_bytes",
                              "pallas_kernels", "peak_bytes"}
        assert 0 < graph["hbm_bytes"] <= graph["bytes_accessed"], graph
        assert report["resident_bytes_per_chip"] < graph["peak_bytes"] <= report["peak_bytes_per_chip"]
        assert set(graph["hbm"]) == {"arguments", "outputs", "temp", "code"} and graph["compile_seconds"] > 0
        kind = graph["name"].removeprefix("draft ").removeprefix("steps ").removeprefix("catch-up ").split()[0]
        expected = {"prefill": ["prefill_attention"], "decode": ["paged_attention"],
                    "verify": ["paged_attention"]}.get(kind, [])
        assert graph["pallas_kernels"] == expected, graph
    assert report["peak_bytes_per_chip"] <= 0.9 * report["hbm_per_chip_bytes"] and report["kv_cache_blocks"] > 1000
    assert "bfloat16" in out and "fits" in out
    assert os.path.isfile(os.path.join(report["executables"], "manifest.json"))


def fit_with_a_larger_draft(root: str) -> dict:
    """A job whose draft model outweighs its target (config only), on a chip of ~200 MiB
    usable: the figures of its fit."""
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import compile_job
    from tpu_executor.tools.random_checkpoint import TPU_TINY, write_config

    target = write_config(os.path.join(root, "target"), "llama")
    draft = write_config(os.path.join(root, "draft"), "llama", dict(TPU_TINY, hidden_size=1024, intermediate_size=4096))
    options = dict(max_model_len=256, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
                   decode_context_buckets=(256,), max_logprobs=0, cache_dir=None, memory_utilization=0.0125,
                   speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    report = compile_job(target, Target.parse("v5e-1"), options, show_progress=False)
    return {"fits": report.fits, "usable": report.usable_bytes, "weights": report.weight_bytes,
            "draft_weights": report.draft_weight_bytes, "blocks": report.num_blocks, "block": report.block_bytes,
            "resident": report.resident_bytes, "peaks": {g.name: g.peak for g in report.graphs}}


@pytest.mark.slow  # libtpu compiles a small plan with a draft model (about a minute)
def test_the_fit_counts_the_draft_model_and_every_graph_beside_all_that_stays_resident(tmp_path):
    """The draft's weights (more than the target's here) and its KV cache are taken before the
    target's cache is sized; every graph, the samplers and the drafter's included, is checked
    beside the weights and caches, which stay in HBM while it runs."""
    fit = in_fresh_process(fit_with_a_larger_draft, str(tmp_path))
    assert fit["fits"] and fit["draft_weights"] > fit["weights"] / 2
    # A block holds the target's and the draft's K/V: all of them stay beside every graph.
    cache = fit["blocks"] * fit["block"]
    assert fit["weights"] + cache < fit["resident"] <= fit["usable"]
    assert len(fit["peaks"]) == 18 and all(fit["resident"] < peak <= fit["usable"] for peak in fit["peaks"].values())
    assert fit["usable"] - fit["resident"] < 64 * fit["block"]  # the cache takes what the graphs leave


def test_a_job_that_cannot_fit_is_refused_before_any_compile(tmp_path):
    result = compile_command(["llama-3.3-70b", "--target", "v6e-1", "--cache-dir", str(tmp_path), "--max-model-len",
                              "4096"], tmp_path, expect_ok=False)
    message = result.stderr
    assert "nothing was compiled" in message and "GiB over" in message, message
    assert "--quantization int8" in message and "more chips (at least --target v6e-8)" in message
    assert not os.path.exists(tmp_path / "aot")


def kernel_warnings_of_head_dim_64(root: str):
    """The compile of a model with head_dim 64 (SmolLM2's), whose attention cannot use Pallas:
    its warnings and kernels, and the error ``strict_kernels`` makes of them."""
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.entrypoints.compile_job import compile_job
    from tpu_executor.tools.random_checkpoint import TPU_TINY, write_config

    checkpoint = write_config(os.path.join(root, "llama"), "llama", dict(TPU_TINY, head_dim=64))
    # The reference attention and cache write copy the cache on a TPU (its 64-wide rows are
    # padded to 128 lanes): a small cache keeps the copies in HBM.
    options = dict(max_model_len=256, max_num_seqs=8, prefill_buckets=(128,), decode_buckets=(8,),
                   decode_context_buckets=(256,), max_logprobs=0, cache_dir=None, num_blocks=256)
    report = compile_job(checkpoint, Target.parse("v5e-1"), options, show_progress=False, model_steps_only=True)
    try:
        compile_job(checkpoint, Target.parse("v5e-1"), dict(options, strict_kernels=True), show_progress=False,
                    model_steps_only=True)
        strict = "no error"
    except ValueError as err:
        strict = str(err)
    return report.kernel_warnings, [g.pallas_kernels for g in report.graphs], strict


@pytest.mark.slow  # libtpu compiles a small plan
def test_a_kernel_that_refuses_a_bucket_is_named_with_its_reason(tmp_path):
    warnings, kernels, strict = in_fresh_process(kernel_warnings_of_head_dim_64, str(tmp_path))
    assert strict.startswith("strict_kernels: 2 op calls fall back") and "head_dim=64" in strict, strict
    assert len(kernels) == 2 and all(not k for k in kernels)  # the model steps alone: a prefill, a decode
    assert any(w.startswith("paged_attention at [[8, 8, 64] bf16") and "head_dim=64 must be a multiple of 128" in w
               and "reference serves it" in w for w in warnings), warnings
    assert any(w.startswith("prefill_attention") for w in warnings)


def test_dtype_auto_is_bf16_on_a_tpu_and_fp32_on_the_cpu(checkpoints, tmp_path):
    from tpu_executor.core.config import resolve_dtype
    from tpu_executor.core.tpu_slices import Target
    from tpu_executor.engine.options import build_engine_config
    from tpu_executor.entrypoints.compile_job import engine_config

    assert build_engine_config(checkpoints["llama"], device="jax").model.dtype == "float32"  # no TPU here
    assert build_engine_config(checkpoints["llama"], device="cpu").model.dtype == "float32"
    assert engine_config(checkpoints["llama"], Target.parse("v5e-1"), {}).model.dtype == "bfloat16"
    assert engine_config(checkpoints["llama"], Target.parse("v5e-1"), {"dtype": "float32"}).model.dtype == "float32"
    assert [resolve_dtype("auto", c, "tpu") for c in ("float32", "float16", "bfloat16")] == ["bfloat16"] * 3
    assert [resolve_dtype("auto", c, "cuda") for c in ("float32", "float16", "bfloat16")] == \
        ["bfloat16", "float16", "bfloat16"]
