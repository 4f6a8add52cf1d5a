"""`tpu-executor bench chunked-prefill` end to end on a tiny model (native path): both engines
run the same workload and report latencies; bad arguments stop it with a message."""
import pytest

from tpu_executor.cli import build_parser

ARGS = ["bench", "chunked-prefill", "--max-model-len", "512", "--long-prompt-len", "400", "--chunk-tokens", "64",
        "--num-running", "2", "--output-len", "12"]


def test_both_engines_measure_the_same_workload(checkpoints, capsys):
    args = build_parser().parse_args(ARGS + ["--model", checkpoints["llama"]])
    rows = args.run(args)
    assert [name for name, _ in rows] == ["chunked", "whole prompts"]
    # every running request's 11 gaps after the long prompt arrived, in both engines
    assert {result["samples"] for _, result in rows} == {2 * 11}
    assert all(0 < r["p50"] <= r["p99"] <= r["max"] and r["ttft"] > 0 for _, r in rows)
    assert "| chunks of 64 |" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [(["--model", "nope"], "neither one of"),
                                            (["--long-prompt-len", "600"], "leaves no room")])
def test_bad_arguments_say_what_is_wrong(checkpoints, extra, message):
    args = build_parser().parse_args(ARGS + ["--model", checkpoints["llama"]] + extra)
    with pytest.raises(SystemExit, match=message):
        args.run(args)
