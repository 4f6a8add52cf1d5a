"""``bench throughput``'s workload and its peers' plumbing (no vLLM needed: a stand-in
interpreter plays the peer's process)."""
from __future__ import annotations

import stat

import pytest

from tpu_executor.bench.peers import RESULT_MARK, run_vllm
from tpu_executor.bench.throughput import Workload, same_tokens


def test_workload_is_seeded_within_its_lengths_and_sizes_the_engine():
    work = Workload(num_prompts=5, min_len=3, max_len=9, output_len=512)
    prompts = work.prompts(vocab_size=100)
    assert prompts == work.prompts(vocab_size=100) != work.prompts(vocab_size=100, seed=1)
    assert len(prompts) == 5 and all(3 <= len(p) <= 9 and all(3 <= t < 100 for t in p) for p in prompts)
    assert work.engine_limits() == {"max_model_len": 521, "max_num_seqs": 5}
    with pytest.raises(SystemExit, match="min_len <= max_len"):
        Workload(min_len=10, max_len=9)


def test_vllm_peer_gets_the_workload_file_and_its_result_line_is_read(tmp_path):
    # A stand-in "python": echoes the workload it was handed back as vLLM's tokens.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\nspec = json.load(open(sys.argv[3]))\n"
                    "assert sys.argv[1] == '-I' and sys.argv[2].endswith('vllm_peer.py')\n"
                    "print('loading...')\n"
                    f"print({RESULT_MARK!r} + json.dumps({{'tokens_per_s': 1.0, 'seconds': 2.0, "
                    "'tokens': spec['prompts'], 'spec': spec}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    work = Workload(num_prompts=2, min_len=4, max_len=4, output_len=7)
    prompts = work.prompts(50)
    result = run_vllm(str(fake), "/ckpt", prompts, work)
    assert result["tokens"] == prompts
    assert result["spec"] == {"model": "/ckpt", "prompts": prompts, "max_tokens": 7, "max_model_len": 11,
                              "max_num_seqs": 2}
    assert result["report"] == "loading..."  # what the peer printed before its result
    assert same_tokens(prompts, result["tokens"]) == 1.0


def test_vllm_peer_failures_say_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="setup_vllm_cpu.sh"):
        run_vllm(str(tmp_path / "missing"), "/ckpt", [[3]], Workload())
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'No module named vllm' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(SystemExit, match="No module named vllm"):
        run_vllm(str(broken), "/ckpt", [[3]], Workload())


def test_vllm_peer_restarts_itself_with_the_preloads_its_docs_prescribe(tmp_path, monkeypatch):
    from tpu_executor.bench import vllm_peer

    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    (tmp_path / "lib").mkdir()
    iomp = tmp_path / "lib" / "libiomp5.so"
    for library in (tcmalloc, iomp):
        library.write_bytes(b"")
    monkeypatch.setattr(vllm_peer, "TCMALLOC_PATHS", ("/nonexistent/libtcmalloc_minimal.so.4", str(tcmalloc)))
    monkeypatch.setattr(vllm_peer.sys, "prefix", str(tmp_path))
    monkeypatch.setattr(vllm_peer.sys, "argv", ["vllm_peer.py", "workload.json"])
    monkeypatch.setenv("LD_PRELOAD", "/other.so")
    restarts = []
    monkeypatch.setattr(vllm_peer.os, "execve", lambda exe, argv, env: restarts.append((argv, env["LD_PRELOAD"])))
    assert vllm_peer.preloads() == [str(tcmalloc), str(iomp)]
    vllm_peer.restart_with_preloads()
    assert restarts == [([vllm_peer.sys.executable, "-I", "vllm_peer.py", "workload.json"],
                         f"{tcmalloc}:{iomp}:/other.so")]
    monkeypatch.setenv("LD_PRELOAD", f"{tcmalloc}:{iomp}")  # the restarted process goes on
    vllm_peer.restart_with_preloads()
    assert len(restarts) == 1 and vllm_peer.preloaded() == [str(tcmalloc), str(iomp)]


def test_no_vllm_preload_reaches_the_peer(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env python3\nimport json, sys\n"
                    f"print({RESULT_MARK!r} + json.dumps({{'argv': sys.argv[3:], 'tokens': []}}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    work = Workload(num_prompts=1, min_len=4, max_len=4, output_len=2)
    assert run_vllm(str(fake), "/ckpt", [[3]], work)["argv"][1:] == []
    assert run_vllm(str(fake), "/ckpt", [[3]], work, preload=False)["argv"][1:] == ["--no-preload"]
