"""``tpu-executor bench cpu-matmul`` times every form this machine has, cold and hot, on the
layer shapes, and the forms it times give the same products."""
from __future__ import annotations

import torch

from tpu_executor.bench import cpu_matmul
from tpu_executor.cli import main


def test_every_form_gives_the_plain_product():
    x, weight = torch.randn(9, 40), torch.randn(40, 50)
    for name, (pack, multiply) in cpu_matmul.forms().items():
        torch.testing.assert_close(multiply(x, pack(weight), 50), x @ weight, rtol=1e-5, atol=1e-5, msg=name)


def test_the_table_has_a_row_per_shape_and_row_count(capsys, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "SHAPES", ((64, 48), (32, 17)))
    main(["bench", "cpu-matmul", "--rows", "3", "8", "--cold-bytes", "1", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "->" in line]
    assert [line.split("|")[1:3] for line in lines] == [[" 64 -> 48 ", " 3 "], [" 64 -> 48 ", " 8 "],
                                                        [" 32 -> 17 ", " 3 "], [" 32 -> 17 ", " 8 "]]
    forms = len(cpu_matmul.forms())
    for line in lines:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == 2 + forms + 1
        for cell in cells[2:2 + forms]:
            cold, hot = (float(value.replace(",", "")) for value in cell.split(" / "))
            assert cold > 0 and hot > 0
        assert cells[-1].endswith("x") or ("C panels" not in cpu_matmul.forms() and cells[-1] == "-")
