"""The hardware line of the CPU benchmarks: CPUID family and model, and a matmul calibration."""
import os

import pytest
import torch

from tpu_executor.bench.hardware import cpu_description, cpuinfo_fields, matmul_gflops

# The head of a KVM guest's /proc/cpuinfo on a Zen 1 EPYC, with a second processor after it.
ZEN1_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu avx2 fma

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: something else
"""


@pytest.fixture
def zen1_cpuinfo(tmp_path) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(ZEN1_CPUINFO)
    return str(path)


def test_first_processor_fields_are_read(zen1_cpuinfo):
    fields = cpuinfo_fields(zen1_cpuinfo)
    assert fields["cpu family"] == "23" and fields["model"] == "1" and fields["model name"] == "AMD EPYC"


def test_description_names_family_model_vector_width_and_cores(zen1_cpuinfo):
    description = cpu_description(zen1_cpuinfo)
    assert description == (f"AMD EPYC (family 23 model 1), {torch.backends.cpu.get_cpu_capability()}, "
                           f"{os.cpu_count()} cores")


def test_missing_cpuinfo_falls_back_to_the_platform(tmp_path):
    description = cpu_description(str(tmp_path / "absent"))
    assert "family" not in description and description.endswith(f"{os.cpu_count()} cores")


def test_matmul_calibration_is_a_plausible_rate():
    gflops = matmul_gflops(repeats=1)
    assert 0.1 < gflops < 1e5  # a 1024^3 matmul: well above a tenth of a GFLOP/s on any CPU
