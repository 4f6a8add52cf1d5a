"""``tpu-executor bench sampler`` runs both samplers on the same rows and prints its table."""
from __future__ import annotations

from tpu_executor.cli import main


def test_bench_sampler_prints_plain_processed_and_host_times(capsys):
    main(["bench", "sampler", "--device", "cpu", "--rows", "8", "--vocab", "512", "--steps", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 8 |")]
    assert len(rows) == 1
    plain, processed, host = (float(cell) for cell in rows[0].strip("|").split("|")[1:])
    assert plain > 0 and processed > 0 and host > 0
