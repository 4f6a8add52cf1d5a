"""``tpu-executor bench serve``: load an OpenAI-compatible server over HTTP and report
throughput, latency percentiles and goodput.

    tpu-executor bench serve --base-url http://127.0.0.1:8000 --request-rate 4
    tpu-executor bench serve --launch --request-rate inf 8 4       # default model, in-process
    tpu-executor bench serve --launch DIR --trace requests.jsonl --goodput ttft:500 tpot:100

Requests come from random lengths (``--input-len``/``--output-len`` +- ``--range-ratio``,
seeded; prompts are random token ids) or a trace file (``--trace``: any format
``tpu-executor tune`` reads, e.g. JSONL ``prompt_len``/``output_len``, Mooncake, Azure CSV).
Arrivals are a Poisson process at ``--request-rate`` (a gamma process with ``--burstiness``
!= 1), or all at once (``inf``).
The client speaks only HTTP, so it measures any OpenAI-compatible server. ``--launch`` starts
our server in this process and first runs the same workload through the offline engine, so
the HTTP/offline ratio is measured side by side.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from tpu_executor.engine.options import HelpFormatter, add_engine_arguments, engine_options_from_args

Workload = List[Tuple[List[int], int]]  # (prompt token ids, output tokens) per request


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("serve", help="load an OpenAI-compatible server; latency and throughput",
                                   description=__doc__, formatter_class=HelpFormatter)
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="a running server (default: --launch one)")
    target.add_argument("--launch", nargs="?", const="", default=None, metavar="MODEL",
                        help="start our server on MODEL (default model if none) in this process")
    target.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    target.add_argument("--api-key", default=None)
    load = parser.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=128)
    load.add_argument("--input-len", type=int, default=128)
    load.add_argument("--output-len", type=int, default=64)
    load.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in len*(1 +- ratio)")
    load.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (default: the "
                                                                   "launched model's vocabulary, else 1000)")
    load.add_argument("--trace", default=None,
                      help="trace file of prompt/output lengths (formats as tune) instead of random ones")
    load.add_argument("--request-rate", nargs="+", default=["inf"], help="requests/s, one run each (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--no-stream", dest="stream", action="store_false",
                      help="ask for whole responses (TTFT is then the whole response's time; no TPOT or ITL)")
    load.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:100")
    load.add_argument("--result-json", default=None, help="write every run's figures here")
    add_engine_arguments(parser, why="For --launch: the engine of `tpu-executor serve`, with its defaults.")
    parser.set_defaults(run=run)
    return parser


# ---- workload ------------------------------------------------------------------------------
def random_workload(num: int, input_len: int, output_len: int, ratio: float, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))
    return [([rng.randrange(10, vocab) for _ in range(length(input_len))], length(output_len)) for _ in range(num)]


def trace_workload(path: str, vocab: int, seed: int) -> Workload:
    """Lengths from a trace file (any format ``tpu-executor tune`` reads); a bad row fails with
    its line number."""
    from tpu_executor.tuning.traces import TraceError, load_trace

    rng = random.Random(seed)
    try:
        trace = load_trace(path)
    except TraceError as err:
        raise SystemExit(str(err)) from None
    return [([rng.randrange(10, vocab) for _ in range(r.prompt_len)], r.output_len) for r in trace]


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> List[float]:
    """Seconds before each request: gamma gaps with mean 1/rate (exponential at burstiness 1)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


# ---- one request ---------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: List[float] = field(default_factory=list)
    streamed: bool = True

    @property
    def tpot(self) -> Optional[float]:
        if not self.streamed or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(client, model: str, prompt: List[int], output_len: int, stream: bool = True) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    if not stream:
        return await send_whole(client, body)
    body.update(stream=True, stream_options={"include_usage": True})
    result, start, last = RequestResult(), time.perf_counter(), None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data, now = json.loads(line[6:]), time.perf_counter()
                if "error" in data:
                    result.error = data["error"]["message"]
                    return result
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                if data["choices"]:
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
    except Exception as err:  # noqa: BLE001 - a failed request is a figure, not a crash
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.e2e, result.ok = time.perf_counter() - start, True
    return result


async def send_whole(client, body: Dict) -> RequestResult:
    """One request answered in one JSON body: the client sees its first token with the last."""
    result, start = RequestResult(streamed=False), time.perf_counter()
    try:
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {response.text[:200]!r}"
            return result
        result.output_tokens = response.json()["usage"]["completion_tokens"]
    except Exception as err:  # noqa: BLE001 - a failed request is a figure, not a crash
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.e2e = result.ttft = time.perf_counter() - start
    result.ok = True
    return result


async def run_load(base_url: str, model: str, api_key: Optional[str], workload: Workload, rate: float,
                   burstiness: float, max_concurrency: Optional[int], seed: int,
                   stream: bool = True) -> Tuple[List[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency or len(workload))
    limits = httpx.Limits(max_connections=max_concurrency or len(workload))

    async def one(client, prompt, output_len):
        async with gate:
            return await send(client, model, prompt, output_len, stream)

    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=3600, limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for gap, (prompt, output_len) in zip(arrival_gaps(len(workload), rate, burstiness, seed), workload):
            await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(client, prompt, output_len)))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


# ---- figures -------------------------------------------------------------------------------
def percentiles(values: List[float]) -> Dict[str, Optional[float]]:
    """Mean and percentiles; None for a figure the run has none of (ITL of whole responses)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(ordered), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def summarize(results: List[RequestResult], seconds: float, workload: Workload,
              slos_ms: Dict[str, float]) -> Dict:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(len(p) for (p, _), r in zip(workload, results) if r.ok)
    ms = {"ttft": [r.ttft * 1e3 for r in done], "tpot": [r.tpot * 1e3 for r in done if r.tpot is not None],
          "itl": [x * 1e3 for r in done for x in r.itls], "e2e": [r.e2e * 1e3 for r in done]}
    good = [r for r in done if all((getattr(r, k) or 0) * 1e3 <= limit for k, limit in slos_ms.items())]
    return {"completed": len(done), "failed": len(results) - len(done), "duration_s": seconds,
            "request_throughput": len(done) / seconds, "output_throughput": out_tokens / seconds,
            "total_token_throughput": (in_tokens + out_tokens) / seconds,
            "goodput": len(good) / seconds if slos_ms else None,
            "errors": sorted({r.error for r in results if not r.ok})[:5],
            **{f"{name}_ms": percentiles(values) for name, values in ms.items()}}


def _ms(value: Optional[float], width: int, digits: int) -> str:
    return f"{'n/a':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def print_summary(rate: str, summary: Dict) -> None:
    print(f"\nrequest rate {rate}: {summary['completed']} done, {summary['failed']} failed in "
          f"{summary['duration_s']:.1f} s; {summary['request_throughput']:.2f} req/s, "
          f"{summary['output_throughput']:.1f} output tok/s, {summary['total_token_throughput']:.1f} total tok/s"
          + (f", goodput {summary['goodput']:.2f} req/s" if summary["goodput"] is not None else ""))
    for name in ("ttft", "tpot", "itl", "e2e"):
        p = summary[f"{name}_ms"]
        print(f"  {name.upper():5s} ms  " + "  ".join(f"{q} {_ms(p[q], 8, 1)}" for q in ("mean", "p50", "p90", "p99")))
    for error in summary["errors"]:
        print(f"  error: {error}")


def parse_slos(items: List[str]) -> Dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise SystemExit(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        slos[name] = float(value)
    return slos


# ---- the command ---------------------------------------------------------------------------
def offline_throughput(engine, workload: Workload) -> float:
    """Output tokens/s of the engine itself on ``workload``, all requests queued at once."""
    from tpu_executor.core.sampling_params import SamplingParams

    start = time.perf_counter()
    for prompt, output_len in workload:
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(c.token_ids) for delta in engine.step() for c in delta.outputs)
    return tokens / (time.perf_counter() - start)


def run_rates(args, base_url: str, model: str, workload: Workload) -> List[Dict]:
    runs, slos = [], parse_slos(args.goodput)
    for rate in args.request_rate:
        results, seconds = asyncio.run(run_load(base_url, model, args.api_key, workload, float(rate),
                                                args.burstiness, args.max_concurrency, args.seed, args.stream))
        summary = dict(summarize(results, seconds, workload, slos), request_rate=rate)
        print_summary(rate, summary)
        runs.append(summary)
    return runs


def launched(args):
    """(engine, model path) for --launch: the engine built from the engine options."""
    from tpu_executor.engine.llm_engine import LLMEngine
    from tpu_executor.tools.default_model import prepare

    path = args.launch or prepare()
    return LLMEngine.from_options(path, **engine_options_from_args(args)), path


def run(args: argparse.Namespace) -> None:
    if (args.base_url is None) == (args.launch is None):
        raise SystemExit("give exactly one of --base-url (a running server) and --launch (start one here)")
    engine = path = None
    args.seed = getattr(args, "seed", 0)  # the engine option --seed seeds the workload as well
    if args.launch is not None:
        engine, path = launched(args)
    vocab = args.vocab_size or (engine.vocab_size if engine else 1000)
    workload = (trace_workload(args.trace, vocab, args.seed) if args.trace else
                random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.seed))
    report: Dict = {"workload": {"requests": len(workload), "prompt_tokens": sum(len(p) for p, _ in workload),
                                 "output_tokens": sum(n for _, n in workload)}}
    if engine is None:
        report["runs"] = run_rates(args, args.base_url, args.model or first_model(args.base_url, args.api_key),
                                   workload)
    else:
        report.update(run_launched(args, engine, path, workload))
    if args.result_json:
        with open(args.result_json, "w") as out:
            json.dump(report, out, indent=2)


def run_launched(args, engine, path: str, workload: Workload) -> Dict:
    from transformers import AutoTokenizer

    from tpu_executor.engine.async_engine import AsyncLLMEngine
    from tpu_executor.entrypoints.openai.api_server import serve_in_thread
    from tpu_executor.entrypoints.openai.config import ServerConfig

    offline = offline_throughput(engine, workload)
    print(f"offline engine: {offline:.1f} output tok/s on the same workload")
    config = ServerConfig(model_name="bench", port=0, max_waiting_requests=max(256, len(workload)))
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=config.max_waiting_requests)
    with serve_in_thread(async_engine, AutoTokenizer.from_pretrained(path), config) as url:
        runs = run_rates(args, url, "bench", workload)
    saturated = [r for r in runs if math.isinf(float(r["request_rate"]))]
    if saturated:
        print(f"\nHTTP at saturation / offline engine: {saturated[0]['output_throughput'] / offline:.2f}")
    print_table(runs)
    return {"offline_output_throughput": offline, "runs": runs}


def first_model(base_url: str, api_key: Optional[str]) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.get(base_url + "/v1/models", headers=headers).json()["data"][0]["id"]


def print_table(runs: List[Dict]) -> None:
    print("\n| request rate | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | "
          "E2E p50 / p99 ms |\n|---|---|---|---|---|---|---|")
    for r in runs:
        cells = " | ".join(f"{_ms(r[f'{m}_ms']['p50'], 0, 0)} / {_ms(r[f'{m}_ms']['p99'], 0, 0)}"
                           for m in ("ttft", "tpot", "itl", "e2e"))
        print(f"| {r['request_rate']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {cells} |")
