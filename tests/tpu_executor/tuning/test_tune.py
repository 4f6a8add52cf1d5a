"""Bucket tuning end to end: the null-device replay sees what the real engine runs, tuned
buckets meet the waste target on sharegpt-like, bucket files drive every engine, and an engine
started from one compiles exactly its graphs and never again while serving the trace."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from tpu_executor.cli import main
from tpu_executor.core.bucket_file import read_bucket_file
from tpu_executor.core.buckets import BucketPlan, DecodeGraph, PrefillGraph
from tpu_executor.engine.llm_engine import LLMEngine
from tpu_executor.engine.options import build_engine_config
from tpu_executor.tools.published_models import model_directory
from tpu_executor.tuning.lowering import kernel_support, lower_graphs
from tpu_executor.tuning.measure import run_engine
from tpu_executor.tuning.replay import replay
from tpu_executor.tuning.roofline import CostModel, ModelShape, Target
from tpu_executor.tuning.traces import TraceRequest, load_trace
from tpu_executor.tuning.tuner import tune

TINY = dict(max_model_len=320, max_num_seqs=8, max_num_batched_tokens=320, prefill_buckets=(32, 128, 320),
            decode_buckets=(2, 8), decode_context_buckets=(128, 320), memory_budget_bytes=256 << 20)


def test_null_replay_pads_exactly_like_the_real_engine(checkpoints):
    """Same config, same trace: the real engine (native CPU) and the null-device replay count
    the same padded and real work in every dimension, and produce the same tokens count."""
    trace = load_trace("chat", num_requests=24, max_model_len=320, seed=1)
    engine = LLMEngine.from_options(checkpoints["llama"], device="cpu", show_progress=False, **TINY)
    try:
        real = run_engine(engine, trace)
        real_padding = engine.stats().padding
        config = engine.config
    finally:
        engine.shutdown()
    replayed = replay(config, trace, engine.vocab_size)
    assert replayed.stats.padding == real_padding
    assert replayed.output_tokens == real.output_tokens == sum(r.output_len for r in trace)
    assert replayed.stats.kv_blocks_used == 0 and replayed.stats.num_running == 0


def test_sharegpt_like_tuned_buckets_waste_at_most_10_percent_with_24_graphs():
    with model_directory("llama-3-8b") as path:
        config = build_engine_config(path, max_model_len=2048, max_num_seqs=32)
        trace = load_trace("sharegpt-like", num_requests=1000, max_model_len=2048)
        report = tune(config, trace, 128256, max_graphs=24)
    default, chosen = report.candidates[0], report.chosen
    assert chosen.plan.model_graphs <= 24
    assert chosen.worst_waste <= 0.10, chosen.wastes
    assert default.wastes["prefill"] > 0.25  # powers of two pad a third of the prefill work
    assert all(c.worst_waste >= chosen.worst_waste for c in report.candidates if c.plan.model_graphs <= 24)


def test_bucket_file_sets_buckets_and_limits_and_refuses_conflicts(checkpoints, tmp_path):
    path = tmp_path / "buckets.json"
    main(["tune", "--trace", "chat", "--num-requests", "40", "--model", checkpoints["llama"], "--device", "cpu",
          "--max-model-len", "320", "--max-num-seqs", "8", "--max-num-batched-tokens", "320", "--max-graphs", "6",
          "--measure", "0", "--out", str(path)])
    options = read_bucket_file(str(path))
    config = build_engine_config(checkpoints["llama"], bucket_config=str(path))
    assert config.compile.prefill_buckets == options["prefill_buckets"]
    assert (config.max_model_len, config.scheduler.max_num_seqs) == (320, 8)
    with pytest.raises(ValueError, match="sets prefill_buckets; do not pass prefill_buckets as well"):
        build_engine_config(checkpoints["llama"], bucket_config=str(path), prefill_buckets=(32,))
    (tmp_path / "bad.json").write_text('{"prefill_buckets": [16]}')
    with pytest.raises(ValueError, match="is not a bucket file"):
        build_engine_config(checkpoints["llama"], bucket_config=str(tmp_path / "bad.json"))


def test_tune_command_measures_writes_table_csv_json_and_plot(checkpoints, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 20 + 7 * i, "output_len": 4 + i % 5}) + "\n" for i in range(30)))
    out = {name: tmp_path / name for name in ("b.json", "t.csv", "r.json", "p.png")}
    main(["tune", "--trace", str(trace), "--model", checkpoints["llama"], "--device", "cpu", "--max-model-len", "320",
          "--max-num-seqs", "8", "--max-num-batched-tokens", "320", "--max-graphs", "8", "--measure", "6",
          "--out", str(out["b.json"]), "--csv", str(out["t.csv"]), "--json", str(out["r.json"]),
          "--plot", str(out["p.png"])])
    printed = capsys.readouterr().out
    assert "replayed 30 requests" in printed and "optimal" in printed
    assert "output tok/s serving the first 6 requests" in printed and "cost model on this CPU" in printed
    assert "for the whole trace at measured model step times" in printed
    report = json.loads(out["r.json"].read_text())
    assert {c["name"] for c in report["candidates"]} >= {"default", "pow2", "optimal"}
    assert set(report["measured"]) == {"default", "optimal"}
    assert report["measured"]["optimal"]["trace_tokens_per_s"] > 0
    assert out["t.csv"].read_text().startswith("scheme,model graphs")
    assert out["p.png"].read_bytes()[:4] == b"\x89PNG"


def test_bad_trace_fails_the_command_with_its_line(checkpoints, tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt_len": 5, "output_len": 2}\n{"prompt_len": -1, "output_len": 2}\n')
    with pytest.raises(SystemExit, match=r"t\.jsonl:2: prompt_len must be >= 1"):
        main(["tune", "--trace", str(trace), "--model", checkpoints["llama"], "--device", "cpu", "--measure", "0",
              "--max-model-len", "320", "--max-num-batched-tokens", "320"])


def test_kernels_lower_for_the_tpu_and_a_bad_block_shape_is_reported():
    shape = ModelShape(layers=2, hidden=1024, intermediate=2048, heads=8, kv_heads=2, head_dim=128, vocab=1000)
    graphs = [PrefillGraph(128), DecodeGraph(8, 4)]
    assert [r.error for r in lower_graphs(graphs, shape, tp=1, block_size=16)] == [None, None]
    bad = lower_graphs([DecodeGraph(8, 4)], shape, tp=1, block_size=8)  # bf16 pages need rows of 16
    assert "block_size=8 must be a multiple of 16" in bad[0].error
    assert "head_dim 64" in kernel_support(ModelShape(2, 576, 1536, 9, 3, 64, 1000), tp=1)


def test_roofline_decode_is_memory_bound_and_long_prefill_compute_bound():
    with model_directory("llama-3-8b") as path:
        from tpu_executor.worker.model_loader import load_hf_config
        shape = ModelShape.from_hf_config(load_hf_config(path))
    target = Target.parse("v5e-1")
    cost = CostModel(shape, target.chip, tp=1)
    # A decode step reads every weight but the input embedding (one row a token).
    weights_s = (shape.weight_params() - shape.vocab * shape.hidden) * 2 / target.chip.hbm_bytes_per_s
    assert cost.decode_seconds(DecodeGraph(1, 1), 16) == pytest.approx(weights_s, rel=0.05)
    assert cost.prefill_seconds(PrefillGraph(2048)) > 2 * 2048 * 7e9 / target.chip.peak_flops
    assert Target.parse("v5p-8").num_chips == 4 and Target.parse("v6e-8").num_chips == 8
    with pytest.raises(ValueError, match="not a TPU slice"):
        Target.parse("a100-8")


def test_roofline_verify_reads_each_sequences_kv_once():
    """A verify graph (k + 1 queries a sequence) reads the weights and each sequence's KV once:
    on a v6e a Llama-3-8B verify of 64 sequences x 5 tokens at 4,096 tokens of context costs
    what their decode does; a row per token (each reading its context) would cost over 3x."""
    with model_directory("llama-3-8b") as path:
        from tpu_executor.worker.model_loader import load_hf_config
        shape = ModelShape.from_hf_config(load_hf_config(path))
    cost = CostModel(shape, Target.parse("v6e-1").chip, tp=1)
    decode = cost.decode_seconds(DecodeGraph(64, 256), 16)
    assert cost.decode_seconds(DecodeGraph(64, 256, queries=5), 16) == pytest.approx(decode, rel=0.02)
    assert cost.decode_seconds(DecodeGraph(64 * 5, 256), 16) > 3 * decode


def test_roofline_and_hbm_fit_take_quantized_weight_bytes():
    """INT8 and INT4 layers (the LM head and embedding stay bf16): a Llama-3.1-8B decode of one
    row reads about half and a third of bf16's bytes, and the freed memory holds more KV blocks."""
    from tpu_executor.tuning.roofline import hbm_fit, linear_bytes_per_weight

    with model_directory("llama-3.1-8b") as path:
        from tpu_executor.worker.model_loader import load_hf_config
        shape = ModelShape.from_hf_config(load_hf_config(path))
    chip = Target.parse("v6e-1").chip
    costs = {q: CostModel(shape, chip, tp=1, weight_bytes=linear_bytes_per_weight(q)) for q in (None, "int8", "int4")}
    decode = {q: cost.decode_seconds(DecodeGraph(1, 1), 16) for q, cost in costs.items()}
    assert 0.5 < decode["int8"] / decode[None] < 0.6 and 0.3 < decode["int4"] / decode[None] < 0.4
    blocks = {q: hbm_fit(cost, 64, 4096, 512, 16).max_kv_blocks for q, cost in costs.items()}
    assert blocks[None] < blocks["int8"] < blocks["int4"]
    weights = {q: hbm_fit(cost, 64, 4096, 512, 16).weight_bytes for q, cost in costs.items()}
    assert weights["int4"] / 2 ** 30 == pytest.approx(5.3, abs=0.3)  # the compile report: 5.41 GiB


def test_a_published_quantized_checkpoint_is_costed_in_its_own_bytes(tmp_path):
    """A GPTQ 4-bit checkpoint (groups of 128, zero points) needs no --quantization: its layer
    weights cost half a byte plus a scale and a zero per 128 inputs."""
    from tpu_executor.tuning.tuner import target_cost
    from tpu_executor.worker.model_loader import load_hf_config

    with model_directory("llama-3.1-8b") as path:
        shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False,
                                     "desc_act": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_hf_config(load_hf_config(str(tmp_path)))
    assert shape.checkpoint_weight_bytes == pytest.approx(0.5 + 8 / 128)
    engine_config = build_engine_config(str(tmp_path), max_model_len=4096)
    assert target_cost(shape, Target.parse("v6e-1"), 1, engine_config).weight_bytes == shape.checkpoint_weight_bytes


# Parameter counts the model cards publish (billions; Gemma-3-27B's language model).
PUBLISHED_BILLIONS = {"llama-3-8b": 8.03, "llama-3.1-8b": 8.03, "llama-3.3-70b": 70.6, "qwen3-8b": 8.19,
                      "qwen3-32b": 32.8, "qwen3-30b-a3b": 30.5, "gemma-7b": 8.54, "gemma-3-27b": 27.0}


@pytest.mark.parametrize("name", sorted(PUBLISHED_BILLIONS))
def test_published_shapes_load_and_add_up_to_their_model_cards(name):
    """Each published config loads as the engine would load it (RoPE type and tensor-parallel
    split checked), and its weights add up to the published size within 6% (the cost model
    counts the LM head apart, since a step reads it; a tied one is no weight of its own)."""
    from tpu_executor.models.layers.parallel import check_tensor_parallel
    from tpu_executor.models.layers.rotary import check_rope
    from tpu_executor.tools.published_models import MODEL_SHAPES
    from tpu_executor.worker.model_loader import load_hf_config

    assert set(PUBLISHED_BILLIONS) == set(MODEL_SHAPES)
    with model_directory(name) as path:
        hf = load_hf_config(path)
    check_rope(hf)
    check_tensor_parallel(hf, 8)
    shape = ModelShape.from_hf_config(hf)
    weights = shape.weight_params() - (shape.vocab * shape.hidden if hf.tie_word_embeddings else 0)
    assert weights / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], rel=0.06)


SERVE_THE_TRACE = textwrap.dedent("""
    import json, sys
    from tpu_executor import LLM
    from tpu_executor.core.buckets import BucketPlan
    from tpu_executor.tuning.measure import run_engine
    from tpu_executor.tuning.traces import TraceRequest, load_trace
    llm = LLM(sys.argv[1], device="xla", bucket_config=sys.argv[2], cache_dir=None, num_blocks=200,
              show_progress=False)
    planned = len(BucketPlan.from_config(llm.engine.config).graphs())
    run = run_engine(llm.engine, load_trace("chat", num_requests=40, max_model_len=320, seed=2))
    print(json.dumps([run.graphs_at_warmup, planned, run.graphs_after_warmup, run.output_tokens]))
""")


@pytest.mark.slow
def test_engine_from_a_tuned_file_compiles_exactly_its_graphs_and_never_recompiles(checkpoints, tmp_path):
    """Fresh process (XLA's in-memory cache would serve graphs of earlier engines)."""
    path = tmp_path / "buckets.json"
    main(["tune", "--trace", "chat", "--num-requests", "40", "--model", checkpoints["llama"], "--device", "cpu",
          "--max-model-len", "320", "--max-num-seqs", "8", "--max-num-batched-tokens", "320", "--max-graphs", "6",
          "--measure", "0", "--seed", "2", "--out", str(path)])
    result = subprocess.run([sys.executable, "-c", SERVE_THE_TRACE, checkpoints["llama"], str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled, planned, after, tokens = json.loads(result.stdout.strip().splitlines()[-1])
    assert compiled == planned and after == 0 and tokens > 0
    config = build_engine_config(checkpoints["llama"], bucket_config=str(path))
    assert planned == len(BucketPlan.from_config(config).graphs())


def test_arrival_times_are_honoured_on_the_targets_clock(tmp_path):
    """A trace arriving at 2 requests/s runs smaller decode batches than the same requests all
    at once, and the virtual clock passes the last arrival."""
    rows = [{"prompt_len": 100 + i, "output_len": 50, "arrival_s": i / 2} for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with model_directory("llama-3-8b") as model:
        config = build_engine_config(model, max_model_len=1024)
        from tpu_executor.worker.model_loader import load_hf_config
        shape = ModelShape.from_hf_config(load_hf_config(model))
        trace = load_trace(str(path))
        paced = tune(config, trace, 128256, 8, Target.parse("v5e-8"), shape)
        at_once = tune(config, [TraceRequest(r.prompt_len, r.output_len) for r in trace], 128256, 8)
    assert paced.replay.virtual_seconds >= 19.5
    assert paced.dims["rows"].sizes.mean() < at_once.dims["rows"].sizes.mean() / 4


def test_a_bucket_whose_kernel_does_not_lower_is_dropped_with_its_reason(monkeypatch):
    from tpu_executor.tuning import tuner
    from tpu_executor.tuning.lowering import LoweringResult

    failing = []

    def lower(graphs, *args, **kwargs):  # the smallest prefill bucket fails to lower
        graphs = list(graphs)
        failing.append(min((g for g in graphs if isinstance(g, PrefillGraph)), key=lambda g: g.num_tokens))
        return [LoweringResult(g, "prefill_attention", "MosaicError: block shape" if g == failing[0] else None)
                for g in graphs]
    monkeypatch.setattr(tuner, "lower_graphs", lower)
    with model_directory("llama-3-8b") as path:
        config = build_engine_config(path, max_model_len=2048)
        from tpu_executor.worker.model_loader import load_hf_config
        shape = ModelShape.from_hf_config(load_hf_config(path))
        report = tune(config, load_trace("chat", num_requests=300, max_model_len=2048), 128256, 24,
                      Target.parse("v5e-8"), shape)
    assert failing[0].num_tokens not in report.chosen.plan.prefill
    assert report.chosen.plan.prefill[-1] == 2048
    assert any(f"dropped: prefill_attention at {failing[0]}: MosaicError" in n for n in report.lowering_notes)


def tune_and_compile(root: str, trace: str) -> str:
    """``tune --target v5e-1 --compile`` on a config with TPU-sized heads: its printed lines."""
    import contextlib
    import io
    import os

    from tpu_executor.tools.random_checkpoint import write_config

    checkpoint = write_config(os.path.join(root, "llama"), "llama")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["tune", "--trace", trace, "--model", checkpoint, "--target", "v5e-1", "--compile", "--measure", "0",
              "--max-model-len", "512", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
              "--max-graphs", "3", "--max-logprobs", "0", "--json", os.path.join(root, "r.json")])
    return printed.getvalue()


@pytest.mark.slow  # libtpu compiles the chosen plan
def test_tune_compile_prints_the_compilers_figures_beside_the_roofline(tmp_path):
    from tests.pallas_kernels.kernel_cases import in_fresh_process

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 20 + 9 * i, "output_len": 4 + i % 5}) + "\n" for i in range(30)))
    printed = in_fresh_process(tune_and_compile, str(tmp_path), str(trace))
    line = next(line for line in printed.splitlines() if line.startswith("compiled with libtpu"))
    assert "compiler vs roofline per chip: weight bytes" in line and "KV blocks that fit" in line and "fits" in line
    compiled = json.loads((tmp_path / "r.json").read_text())["compiled"]
    assert compiled["fits"] and compiled["kv_blocks"][0] > 1000 and compiled["graphs"] >= 4
    ours, roofline = compiled["weight_bytes"]
    assert abs(ours - roofline) / roofline < 0.05, compiled  # the same weights counted two ways
    # Every model step's floor from the compiler's counts beside the roofline's, both printed.
    steps = compiled["step_seconds"]
    assert {name.split()[0] for name, _, _ in steps} == {"prefill", "decode"}
    assert all(floor > 0 and estimate > 0 for _, floor, estimate in steps), steps
    assert sum("ms from the compiler's HBM bytes and FLOPs" in line for line in printed.splitlines()) == len(steps)
