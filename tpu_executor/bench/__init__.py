"""``tpu-executor bench``: the benchmark commands, one module each, and their helpers
(``hardware.py``: the CPU line every report names; ``profile.py``: where a step's time goes).

``throughput`` (offline, against transformers), ``startup`` (cold and warm compile cache),
``serve`` (an OpenAI server under load),
``replicas`` (the replicated server: scaling over replicas, routing overhead, prefix routing),
``host`` (the host's work per engine step), ``chunked-prefill`` (latency while a long prompt
arrives), ``speculative`` (n-gram speculative decoding against none), ``lora`` (LoRA adapters
in the batch against the base model), ``sampler`` (the
sampler, plain and with logits processing), ``structured`` (JSON-schema outputs against
unconstrained ones), ``kernels`` (the Pallas kernels against their references), ``cpu-matmul``
(the native CPU path's matmul forms side by side), ``cpu-kernels`` (its other C kernels
against the forms that serve their ops without them), ``quantized`` (native-path decode speed
and log-prob error of INT8 and INT4 weights against fp32), ``weight-bytes`` (a decode step's
linear-weight bytes, bf16 against INT8 and INT4, from the TPU compiler).
"""
from __future__ import annotations

import argparse

from tpu_executor.bench import (
    chunked,
    cpu_kernels,
    cpu_matmul,
    host,
    kernels,
    lora,
    quantized,
    replicas,
    sampler,
    serve,
    speculative,
    startup,
    structured,
    throughput,
    weight_bytes,
)

COMMANDS = (throughput, startup, serve, replicas, host, chunked, speculative, lora, sampler, structured, kernels,
            cpu_matmul, cpu_kernels, quantized, weight_bytes)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``bench`` and its subcommands."""
    parser = subparsers.add_parser(
        "bench", help="benchmarks: offline throughput, start-up, a server under load, replicas, host work, "
                      "chunked prefill, speculative decoding, LoRA adapters, the sampler, structured outputs, kernels, "
                      "CPU matmul forms, quantized weight bytes")
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module in COMMANDS:
        module.add_parser(benchmarks)
    return parser
