"""``tpu-executor bench replicas``: the replicated server (Ray Serve) at several replica counts,
on a simulated device that holds no host cores, so replicas scale as they would on chips
instead of fighting over this machine's cores.

    tpu-executor bench replicas                          # 1, 2 and 4 replicas, 20 ms a step
    tpu-executor bench replicas --replicas 1 2 --device-ms 50 --num-prompts 256

Three tables: output tok/s per replica count (streamed, twice the sequences the replicas run
at once in flight) against linear scaling from one replica; what the ingress and router add
to a request (the end-to-end time of one-token requests sent one at a time, one replica
against the single-engine server on the same device); and the prefix-cache hit rate and time
to first token of groups of requests that share a long system prompt, routed by prefix against
least-loaded (an uncached prefix costs one device step per ``--max-num-batched-tokens`` of it).
Each run starts a local Ray instance with the chips it needs (``--ray-address`` uses a cluster
of yours instead).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import socket
import time
from typing import Dict, Optional

from tpu_executor.bench.serve import Workload, random_workload, run_load, summarize
from tpu_executor.engine.options import HelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("replicas", help="the replicated server: scaling, routing overhead, prefix routing",
                                   description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4], help="replica counts to run")
    parser.add_argument("--device-ms", type=float, default=20.0, help="the simulated device's time per step")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="running sequences per replica (a few waves "
                                                                    "of --num-prompts keep every replica full)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256, help="tokens per step per replica")
    parser.add_argument("--prefix-groups", type=int, default=64, help="groups sharing a system prompt")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of each group's system prompt")
    parser.add_argument("--prefix-rate", type=float, default=8.0, help="requests/s of the prefix workload")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="whole responses in the scaling runs (one message per request, not one per token)")
    parser.add_argument("--ray-address", default=None, help="a Ray cluster with TPU resources (default: a local one)")
    parser.set_defaults(run=run)
    return parser


def engine_options(args: argparse.Namespace) -> Dict:
    """One replica's engine: the native path on the held device, context for the longest prompt."""
    context = -(-(args.prefix_len + 2 * args.input_len + args.output_len + 16) // 256) * 256
    # Room for the running sequences and for every group's system prompt, so that the prefix
    # workload measures routing, not evictions.
    blocks = args.max_num_seqs * (context // 16 + 1) + args.prefix_groups * (args.prefix_len // 16 + 1) + 1
    return dict(device="cpu", max_model_len=context, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, prefill_buckets=(args.max_num_batched_tokens,),
                decode_buckets=(args.max_num_seqs,), decode_context_buckets=(context,), num_blocks=blocks,
                cache_dir=None)


def prefix_workload(args: argparse.Namespace, vocab: int) -> Workload:
    """``--num-prompts`` requests in ``--prefix-groups`` groups; a group's prompts start with the
    same ``--prefix-len`` tokens, then ``--input-len`` of their own; shuffled."""
    rng = random.Random(7)
    systems = [[rng.randrange(10, vocab) for _ in range(args.prefix_len)] for _ in range(args.prefix_groups)]
    workload = [(systems[i % args.prefix_groups] + [rng.randrange(10, vocab) for _ in range(args.input_len)],
                 args.output_len) for i in range(args.num_prompts)]
    rng.shuffle(workload)
    return workload


class ReplicatedTarget:
    """A local Ray instance (or ``--ray-address``) with Serve on a free port; ``run`` deploys the
    replicated server on the simulated device, loads it and deletes it again."""

    def __init__(self, args: argparse.Namespace, path: str):
        self.args, self.path = args, path

    def __enter__(self) -> "ReplicatedTarget":
        import ray
        from ray import serve

        if self.args.ray_address:
            ray.init(address=self.args.ray_address, log_to_driver=False)
        else:
            ray.init(resources={"TPU": max(self.args.replicas)}, include_dashboard=False, log_to_driver=False)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        return self

    def run(self, count: int, routing: str, workload: Workload, rate: float = float("inf"),
            max_concurrency: Optional[int] = None, stream: bool = True) -> Dict:
        from ray import serve

        from tpu_executor.bench.null_model import held_device_worker
        from tpu_executor.entrypoints.openai.config import ReplicaConfig, ServerConfig
        from tpu_executor.entrypoints.ray_serve.app import build_application

        replicas = ReplicaConfig(data_parallel_size=count, routing=routing)
        app = build_application(self.path, engine_options(self.args), ServerConfig(model_name="bench"), replicas,
                                worker_class=held_device_worker(self.args.device_ms))
        serve.run(app, name=replicas.app_name, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{self.port}"
        try:
            summary = load(url, workload, rate, max_concurrency, stream)
            time.sleep(2.5)  # the replicas' stats arrive each second
            return dict(summary, prefix_hit_rate=prefix_hit_rate(url))
        finally:
            serve.delete(replicas.app_name)

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def prefix_hit_rate(url: str) -> float:
    """Prompt tokens found in the replicas' prefix caches over prompt tokens looked up."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^tpu_executor:{name}{{replica=\S+}} (\S+)$", text, re.M))
    queries = total("prefix_cache_queries_total")
    return total("prefix_cache_hits_total") / queries if queries else 0.0


def load(url: str, workload: Workload, rate: float, max_concurrency: Optional[int] = None,
         stream: bool = True) -> Dict:
    results, seconds = asyncio.run(run_load(url, "bench", None, workload, rate, 1.0, max_concurrency, 0, stream))
    return summarize(results, seconds, workload, {})


def single_engine(args: argparse.Namespace, path: str, workload: Workload) -> Dict:
    """``workload`` one request at a time through the single-engine server on the same device."""
    from transformers import AutoTokenizer

    from tpu_executor.bench.null_model import held_device_worker
    from tpu_executor.engine.async_engine import AsyncLLMEngine
    from tpu_executor.engine.llm_engine import LLMEngine
    from tpu_executor.entrypoints.openai.api_server import serve_in_thread
    from tpu_executor.entrypoints.openai.config import ServerConfig

    engine = LLMEngine.from_options(path, show_progress=False, worker_class=held_device_worker(args.device_ms),
                                    **engine_options(args))
    with serve_in_thread(AsyncLLMEngine(engine), AutoTokenizer.from_pretrained(path),
                         ServerConfig(model_name="bench", port=0)) as url:
        return load(url, workload, float("inf"), max_concurrency=1)


def run(args: argparse.Namespace) -> None:
    from tpu_executor.bench.hardware import cpu_description
    from tpu_executor.bench.host import VOCAB, tiny_checkpoint

    path = tiny_checkpoint()
    vocab = VOCAB // 2  # below what the tokenizer learned
    throughput = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=0)
    one_token = random_workload(50, args.input_len, 1, 0.0, vocab, seed=1)
    prefixed = prefix_workload(args, vocab)
    pair = min(2, max(args.replicas))
    direct = single_engine(args, path, one_token)
    with ReplicatedTarget(args, path) as target:
        # Twice the sequences the replicas run at once keeps every replica full; all requests at
        # once would make the client's own connection pool the bottleneck on a small machine.
        scaling = {n: target.run(n, "prefix", throughput, stream=args.stream, max_concurrency=2 * n * args.max_num_seqs)
                   for n in args.replicas}
        through_serve = target.run(1, "prefix", one_token, max_concurrency=1)
        routed = {routing: target.run(pair, routing, prefixed, rate=args.prefix_rate)
                  for routing in ("prefix", "least_loaded")}
    print(f"machine: {cpu_description()}")
    print_scaling(args, scaling)
    print_overhead(direct, through_serve)
    print_routing(args, pair, routed)


def print_scaling(args: argparse.Namespace, scaling: Dict[int, Dict]) -> None:
    base = scaling[min(scaling)]["output_throughput"] / min(scaling)
    print(f"\nscaling: {args.num_prompts} requests of {args.input_len} -> {args.output_len} tokens, "
          f"{'streamed' if args.stream else 'whole'}, 2 x {args.max_num_seqs} in flight per replica, "
          f"{args.device_ms:g} ms a device step")
    print(f"{'replicas':>8} {'done':>5} {'output tok/s':>13} {'x linear':>9} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for count, summary in scaling.items():
        print(f"{count:>8} {summary['completed']:>5} {summary['output_throughput']:>13.1f} "
              f"{summary['output_throughput'] / (base * count):>9.2f} {summary['ttft_ms']['p50']:>12.1f} "
              f"{_ms(summary['tpot_ms']['p50']):>12}")


def _ms(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def print_overhead(direct: Dict, through_serve: Dict) -> None:
    print("\nper request, one-token requests one at a time (end-to-end ms)")
    print(f"{'server':>22} {'p50':>8} {'p99':>8}")
    for name, summary in (("single engine", direct), ("1 replica (Serve)", through_serve)):
        print(f"{name:>22} {summary['e2e_ms']['p50']:>8.1f} {summary['e2e_ms']['p99']:>8.1f}")
    print(f"{'added by ingress+router':>22} {through_serve['e2e_ms']['p50'] - direct['e2e_ms']['p50']:>8.1f} "
          f"{through_serve['e2e_ms']['p99'] - direct['e2e_ms']['p99']:>8.1f}")


def print_routing(args: argparse.Namespace, pair: int, routed: Dict[str, Dict]) -> None:
    print(f"\nrouting: {pair} replicas, {args.num_prompts} requests in {args.prefix_groups} groups sharing "
          f"{args.prefix_len} prompt tokens, {args.prefix_rate:g} requests/s")
    print(f"{'routing':>13} {'prefix hits':>11} {'TTFT mean ms':>13} {'p50':>7} {'p90':>7} {'p99':>7}")
    for routing, summary in routed.items():
        ttft = summary["ttft_ms"]
        print(f"{routing:>13} {summary['prefix_hit_rate']:>11.1%} {ttft['mean']:>13.1f} {ttft['p50']:>7.1f} "
              f"{ttft['p90']:>7.1f} {ttft['p99']:>7.1f}")
