"""What a CPU benchmark ran on, in words a reader can compare across machines.

Under a hypervisor the model name is often just "AMD EPYC" or "Intel Xeon", which hides the
generation: a Zen 1 EPYC executes each 256-bit AVX2 FMA as two 128-bit halves and so does about
half the fp32 matmul work per cycle of a Zen 2 or later part with the same name. The CPUID family
and model tell them apart, and a short timed matmul says what this machine delivers today (a
shared host can deliver less than its peak).
"""
from __future__ import annotations

import os
import platform
import time
from typing import Dict

CALIBRATION_SIZE = 1024  # rows = columns = inner dimension of the timed fp32 matmul


def cpuinfo_fields(path: str = "/proc/cpuinfo") -> Dict[str, str]:
    """The first processor's fields of a cpuinfo file (empty where there is no such file)."""
    fields: Dict[str, str] = {}
    try:
        with open(path) as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block ends at the first blank line
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_description(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, CPUID family/model, the widest vector instructions torch uses
    on it (matmul speed, and which matmul form wins, differ between AVX2 and AVX-512
    machines) and the core count, e.g. ``AMD EPYC (family 23 model 1), AVX2, 2 cores``."""
    import torch

    fields = cpuinfo_fields(cpuinfo)
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores"


def matmul_gflops(repeats: int = 10) -> float:
    """fp32 GFLOP/s of one large square matmul on all cores, best of ``repeats`` (about a
    third of a second on a 2-core machine): the ceiling the model's linears can reach here today."""
    import torch

    size = CALIBRATION_SIZE
    left, right = torch.randn(size, size), torch.randn(size, size)
    torch.mm(left, right)  # first call pays for thread start-up and page faults
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(left, right)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9
