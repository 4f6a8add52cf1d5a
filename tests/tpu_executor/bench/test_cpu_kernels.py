"""``tpu-executor bench cpu-kernels`` times each C kernel against the form that serves its op
without it, on the same arguments, and both forms give the op's reference result there."""
from __future__ import annotations

import pytest
import torch

from tpu_executor.bench import cpu_kernels
from tpu_executor.cli import main
from tpu_executor.kernels import register_all


@pytest.mark.parametrize("op", list(cpu_kernels.CASES))
def test_both_contenders_take_the_case_and_match_the_reference(op):
    register_all()
    kinds, build = cpu_kernels.CASES[op]
    args, kwargs = build(cpu_kernels.DECODE_SEQS if "decode" in kinds else cpu_kernels.PREFILL_TOKENS)
    contenders = cpu_kernels.contenders(op, args, kwargs)
    assert [p.name == cpu_kernels.C_PROVIDER for p in contenders] == [True, False]
    spec = __import__(f"tpu_executor.kernels.{op}.ops", fromlist=["SPEC"]).SPEC
    expected = results(spec.reference, args, kwargs)
    for provider in contenders:
        for got, want in zip(results(provider.fn, args, kwargs), expected, strict=True):
            spec.assert_close(got, want, provider.name)


def results(fn, args, kwargs):
    """What ``fn`` returns (one tensor or several) and the tensors it writes in place (the KV
    caches), on copies of the arguments."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*copies, **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    outs = list(out) if isinstance(out, tuple) else [] if out is None else [out]
    return outs + [c for c, a in zip(copies, args) if isinstance(a, torch.Tensor) and not torch.equal(c, a)]


def test_the_table_has_a_row_per_op_and_step(capsys):
    main(["bench", "cpu-kernels", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [tuple(cell.strip() for cell in line.strip("|").split("|")[:2]) for line in lines[1:]]
    assert rows == [(op, kind) for op, (kinds, _) in cpu_kernels.CASES.items() for kind in kinds]
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert float(cells[2].replace(",", "")) > 0 and cells[5].endswith("x") and cells[6].startswith(("yes", "no"))
