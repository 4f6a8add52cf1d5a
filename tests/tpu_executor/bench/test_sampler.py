"""``tpu-executor bench sampler`` runs both samplers on the same rows and prints its table;
``tpu-executor bench structured`` runs both passes and prints theirs."""
from __future__ import annotations

from tpu_executor.cli import main


def table_row(output: str, first_cell: str):
    rows = [line for line in output.splitlines() if line.startswith(f"| {first_cell} |")]
    assert len(rows) == 1, output
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


def test_bench_sampler_prints_plain_processed_host_and_grammar_times(capsys, checkpoints):
    main(["bench", "sampler", "--device", "cpu", "--rows", "8", "--tokenizer", checkpoints["llama"], "--steps", "2"])
    plain, processed, host, grammar = (float(cell) for cell in table_row(capsys.readouterr().out, "8")[1:])
    assert plain > 0 and processed > 0 and host > 0 and grammar > 0


def test_bench_structured_prints_both_rates_and_no_compilation(capsys, checkpoints):
    main(["bench", "structured", "--models", checkpoints["llama"], "--devices", "cpu", "--repeats", "1"])
    cells = table_row(capsys.readouterr().out, checkpoints["llama"])
    plain, constrained = float(cells[2]), float(cells[3])
    assert plain > 0 and constrained > 0 and cells[4].endswith("x") and cells[5] == "0"
