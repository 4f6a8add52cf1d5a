"""``bench quantized`` on a tiny checkpoint: every scheme's rate, and a log-prob change that is
zero for fp32 against itself and positive for INT4; decode and prefill rows."""
from tpu_executor.bench import quantized


def test_the_bench_prints_each_schemes_rate_and_log_prob_change(capsys, checkpoints, monkeypatch):
    monkeypatch.setattr(quantized, "model_path", lambda name: checkpoints["llama"])
    parser = quantized.add_parser(__import__("argparse").ArgumentParser().add_subparsers())
    args = parser.parse_args(["--models", "smollm2", "--batch-sizes", "1", "2", "--output-len", "4",
                              "--text-len", "24", "--prefill-len", "32", "--prefill-prompts", "2",
                              "--quantizations", "none", "int8", "int4", "w8a8"])
    args.run(args)
    table = capsys.readouterr().out.split("| model |")[1].splitlines()[2:]
    assert [row.split(" | ")[1:3] for row in table] == [
        [weights, batch] for weights in ("fp32", "INT8", "INT4", "W8A8") for batch in ("1", "2", "prefill 2 x 32")]
    int4_change = float(table[-4].split(" | ")[-1].rstrip(" |"))
    assert int4_change > 0
