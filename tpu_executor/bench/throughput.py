"""``tpu-executor bench throughput``: throughput of tpu_executor versus transformers' batched
``generate``, side by side in one run (``tpu-executor bench serve`` loads a server instead).

Workload: 32 prompts with lengths uniform in [16, 256] (seeded random token ids), 64 new
tokens each, greedy, fp32. Prints output tokens/s, warm-up time, compiled graphs and padding
waste for each model, then a Markdown table for docs/benchmarks.md and the hardware it ran on (CPUID
family and model, and a matmul calibration at the start and the end of the run: the ratios
depend on the CPU generation, see docs/benchmarks.md).

    tpu-executor bench throughput                     # both models, XLA and native paths
    tpu-executor bench throughput --models gemma-100m --devices xla --skip-transformers
    tpu-executor bench throughput --models gemma-100m --tensor-parallel-sizes 1 2 4 --skip-transformers
    tpu-executor bench throughput --models mixtral-small smollm2 --quantizations none int8
    tpu-executor bench throughput --models gemma-100m --scheduling async sync
    tpu-executor bench throughput --models gemma-100m --devices cpu --profile
    tpu-executor bench throughput --models gemma-100m --devices jax xla cpu

``--profile`` runs the workload a second time (other prompts of the same lengths, so the prefix
cache cannot help) with a phase timer attached, and prints where that run's time went:
engine-thread phases, model-runner phases with prefill and decode apart, on the native CPU path
split into linears / attention / the rest of the model (``tools/step_profile.py``).

Tensor parallelism on a machine without TPUs runs one Ray actor per simulated chip (a local
Ray node advertising that many ``TPU`` resources) and reduces through gloo on host copies:
it shows that the sharded engine works and what the collectives cost, not TPU speed.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List

from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args
from tpu_executor.bench.hardware import CALIBRATION_SIZE, cpu_description, matmul_gflops

NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS = 32, 16, 256, 64
MODELS = ("gemma-100m", "smollm2", "mixtral-small")
# The options each run sweeps over (their own flags below), and the engine settings of the workload.
SWEPT = ("device", "tensor_parallel_size", "quantization", "async_scheduling")
ENGINE_DEFAULTS = dict(max_model_len=MAX_LEN + NEW_TOKENS, max_num_seqs=NUM_PROMPTS,
                       prefill_buckets=(128, 256, 320, 384, 448, 512), decode_buckets=(8, 16, 32),
                       decode_context_buckets=(160, 320))
WHY_DEFAULTS = ("Defaults here fit the workload (prompts of 16-256 tokens, 64 new, 32 at once): max_model_len, "
                "max_num_seqs and the three bucket lists differ from the engine's.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("throughput", help="throughput versus transformers' generate",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-100m", "smollm2"], choices=MODELS)
    parser.add_argument("--devices", nargs="+", default=["xla", "cpu"], help="xla, jax, cpu, cuda, ...")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "int8"])
    parser.add_argument("--scheduling", nargs="+", default=["async"], choices=["async", "sync"],
                        help="asynchronous (default) and/or synchronous scheduling, side by side")
    parser.add_argument("--profile", action="store_true",
                        help="after each timed run, a profiled run of the same workload (tensor parallel size 1)")
    add_engine_arguments(parser, exclude=SWEPT, defaults=ENGINE_DEFAULTS, why=WHY_DEFAULTS)
    parser.set_defaults(run=run)
    return parser


def workload(vocab_size: int, seed: int = 0) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(MIN_LEN, MAX_LEN))]
            for _ in range(NUM_PROMPTS)]


def shifted(prompts: List[List[int]], vocab_size: int) -> List[List[int]]:
    """Prompts of the same lengths with every token id moved by one (no prefix-cache hits)."""
    return [[3 + (t - 2) % (vocab_size - 3) for t in prompt] for prompt in prompts]


def model_path(name: str) -> str:
    from tpu_executor.tools.default_model import prepare
    from tpu_executor.tools.random_checkpoint import GEMMA_100M, MIXTRAL_SMALL, build

    if name == "smollm2":
        return prepare()
    arch, sizes = ("gemma", GEMMA_100M) if name == "gemma-100m" else ("mixtral", MIXTRAL_SMALL)
    return build(os.path.join(os.path.expanduser("~"), ".cache", "tpu_executor", f"{name}-random"), arch, sizes)


def run_engine(path: str, prompts: List[List[int]], options: Dict, profile_prompts=None) -> Dict:
    """Generate the workload with one engine; its throughput, tokens and stats. With
    ``profile_prompts``, then a profiled run of those, whose table is printed."""
    from tpu_executor.core.sampling_params import SamplingParams
    from tpu_executor.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(model=path, **options)
    warmup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    if profile_prompts is not None:
        profiled_run(llm, profile_prompts, params, options)
    llm.shutdown()
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "warmup_s": warmup, "stats": stats,
            "tokens": [o.outputs[0].token_ids for o in outs], "tp": options["tensor_parallel_size"],
            "quantization": options["quantization"] or "fp32",
            "scheduling": "async" if options["async_scheduling"] else "sync"}


def profiled_run(llm, prompts: List[List[int]], params, options: Dict) -> None:
    from tpu_executor.bench.profile import StepProfile, print_profile

    profile = StepProfile(llm.engine)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    profile.detach()
    scheduling = "async" if options["async_scheduling"] else "sync"
    print_profile(f"{os.path.basename(llm.engine.config.model.model)} on {options['device']}, {scheduling} "
                  "scheduling", profile, time.perf_counter() - start)


def run_transformers(path: str, prompts: List[List[int]]) -> Dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=pad)
    elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed}


def on_own_thread(fn, *args):
    """``fn(*args)`` on a thread that ends with it. Torch's CPU ops run on an OpenMP team per
    calling thread; this one's team goes with the thread, so it does not stay alive beside
    the engine's step thread and slow it (see ``UniprocExecutor``)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def run(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    if args.profile and max(args.tensor_parallel_sizes) > 1:
        raise SystemExit("--profile times an in-process engine: use --tensor-parallel-sizes 1")
    if max(args.tensor_parallel_sizes) > 1 and set(args.devices) != {"jax"}:  # the JAX path shards in-process
        start_local_ray(max(args.tensor_parallel_sizes))
    base = engine_options_from_args(args)
    gflops, rows = [on_own_thread(matmul_gflops)], []
    for name in args.models:
        path = model_path(name)
        vocab_size = AutoConfig.from_pretrained(path).vocab_size
        prompts = workload(vocab_size)
        profile_prompts = shifted(prompts, vocab_size) if args.profile else None
        theirs = None if args.skip_transformers else on_own_thread(run_transformers, path, prompts)
        if theirs:
            print(f"{name}: transformers generate {theirs['tokens_per_s']:.1f} tok/s ({theirs['seconds']:.1f} s)")
        for device in args.devices:
            first = None
            for quantization, tp, scheduling in itertools.product(args.quantizations, args.tensor_parallel_sizes,
                                                                  args.scheduling):
                ours = run_engine(path, prompts, dict(base, device=device, tensor_parallel_size=tp,
                                                      quantization=None if quantization == "none" else quantization,
                                                      async_scheduling=scheduling == "async"), profile_prompts)
                first = first or ours
                print_run(name, device, ours, first)
                rows.append((name, device, ours, theirs))
    gflops.append(on_own_thread(matmul_gflops))
    print_table(rows, gflops)


def print_run(name: str, device: str, ours: Dict, first: Dict) -> None:
    stats = ours["stats"]
    same = sum(a == b for x, y in zip(ours["tokens"], first["tokens"]) for a, b in zip(x, y))
    waste = {k: f"{v:.0%}" for k, v in stats.padding.waste().items()}
    print(f"{name} [{device}, tp={ours['tp']}, {ours['quantization']}, {ours['scheduling']}]: {ours['tokens_per_s']:.1f} tok/s "
          f"({ours['seconds']:.1f} s), warm-up {ours['warmup_s']:.1f} s, {stats.graphs_compiled_at_warmup} XLA "
          f"compilations, {stats.graphs_compiled_after_warmup} after warm-up, padding waste {waste}, "
          f"greedy tokens equal to the first row's at {same / (NUM_PROMPTS * NEW_TOKENS):.1%} of positions")


def start_local_ray(chips: int) -> None:
    """A local Ray node that advertises ``chips`` TPU resources, one per simulated chip."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, local cluster
    ray.init(resources={"TPU": chips}, include_dashboard=False, log_to_driver=False)


def print_table(rows, gflops: List[float]) -> None:
    print("\n| model | path | tp | weights | scheduling | engine tok/s | transformers tok/s | ratio | warm-up s | "
          "XLA compilations | prefill padding | decode row padding |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, device, ours, theirs in rows:
        ref = f"{theirs['tokens_per_s']:.1f}" if theirs else "-"
        ratio = f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x" if theirs else "-"
        path = {"xla": "XLA (torch_xla)", "jax": "JAX (torchax)"}.get(device, f"native eager ({device})")
        stats = ours["stats"]
        waste = stats.padding.waste()
        print(f"| {name} | {path} | {ours['tp']} | {ours['quantization']} | {ours['scheduling']} | "
              f"{ours['tokens_per_s']:.1f} | {ref} | "
              f"{ratio} | {ours['warmup_s']:.0f} | {stats.graphs_compiled_at_warmup} | "
              f"{waste['prefill_tokens']:.0%} | {waste['decode_rows']:.0%} |")
    calibration = " -> ".join(f"{g:.0f}" for g in gflops)
    print(f"\nHardware: {cpu_description()}; fp32 matmul {CALIBRATION_SIZE}^3 at {calibration} GFLOP/s (start -> end "
          f"of the run). Workload: {NUM_PROMPTS} prompts, lengths uniform {MIN_LEN}-{MAX_LEN} "
          f"(seed 0), {NEW_TOKENS} new tokens, greedy, fp32; transformers: one batched generate, left-padded.")

