"""The project's text: a short README with the sections a user looks for, one docs file per
topic, commands that run as written, and no development history in any file."""
from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from tpu_executor.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SECTIONS = ("## Install", "## Run", "## Serve", "## Tune", "## Compile before you rent", "## Multi-host", "## Test",
            "## Architecture", "## Benchmarks", "## Known limits")
TOPICS = ("design", "serving", "tuning", "tpu", "benchmarks", "testing", "kernels")
TEXT_SUFFIXES = {".py", ".md", ".c", ".ini", ".txt", ".cfg", ".toml", ".json", ".yaml", ".yml", ""}


def documents():
    return [README] + [ROOT / "docs" / f"{topic}.md" for topic in TOPICS]


def code_blocks(path: pathlib.Path, language: str):
    """The fenced blocks of ``language`` in a Markdown file."""
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


def command_lines(path: pathlib.Path):
    """Every shell command in the file's bash blocks, continuation lines joined, comments cut."""
    for block in code_blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line:
                yield line


def test_readme_is_short_and_has_every_section():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    positions = [text.find("\n" + section + "\n") for section in SECTIONS]
    assert all(p > 0 for p in positions), [s for s, p in zip(SECTIONS, positions) if p < 0]
    assert positions == sorted(positions), "sections out of order"
    for topic in TOPICS:
        assert f"docs/{topic}.md" in text, f"the README does not link docs/{topic}.md"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_every_tpu_executor_command_parses_as_written(path):
    """Each ``tpu-executor ...`` line of the README and docs is a valid command line (its
    subcommand, flags and values), checked by the command's own parser."""
    commands = [line for line in command_lines(path) if line.startswith("tpu-executor")]
    for line in commands:
        words = ["VALUE" if w.startswith("$") else w for w in shlex.split(line)]  # an environment variable
        try:
            build_parser().parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"{path.name}: `{line}` does not parse")


def test_the_scripts_the_docs_name_answer_help():
    scripts = {word for path in documents() for line in command_lines(path)
               for word in re.findall(r"python -m (scripts\.\w+)", line)}
    assert scripts, "no script named"
    for module in sorted(scripts):
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 0, (module, result.stderr[-2000:])


@pytest.mark.slow
def test_the_readme_example_runs(checkpoints, tmp_path):
    """The README's first Python block, as written but for the checkpoint, a tiny one, and the
    native path (the default plan's XLA compile took 3 minutes of the suite here, and the
    engine tests compile exactly that plan already)."""
    example = code_blocks(README, "python")[0]
    assert 'LLM(model="path/to/checkpoint")' in example
    script = tmp_path / "example.py"
    script.write_text(example.replace('LLM(model="path/to/checkpoint")',
                                      f'LLM(model={checkpoints["llama"]!r}, device="cpu")'))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "the example printed no text"


def test_the_readme_openai_example_talks_to_a_live_server(checkpoints, tmp_path):
    """The README's `openai` block, as written but for the server's address, against a server
    of a tiny checkpoint that serves it under the default model's name."""
    from tests.common import live_server, tiny_engine_options
    from tpu_executor.engine.llm_engine import LLMEngine

    example = code_blocks(README, "python")[1]
    assert "http://127.0.0.1:8000/v1" in example
    engine = LLMEngine.from_options(checkpoints["llama"], **tiny_engine_options(device="cpu"))
    with live_server(engine, model_name="SmolLM2-135M-Instruct") as (url, _):
        script = tmp_path / "client.py"
        script.write_text(example.replace("http://127.0.0.1:8000/v1", url + "/v1"))
        result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                                timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# Markers of development history: a project file states what is true now.
HISTORY = [
    re.compile(r"\bissues? #?\d+", re.I),
    re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|\d+(?:st|nd|rd|th)) round\b", re.I),
    re.compile(r"\brounds? of (?:issue|host|work|tuning)\b", re.I),
    re.compile(r"\bstop \d+\b", re.I),
    re.compile(r"\b(?:commit|worktree) [0-9a-f]{7,40}\b", re.I),
]
# A commit id in prose: 7-40 hex digits with letters and digits both, standing alone.
HEX_ID = re.compile(r"(?<![\w.\-/])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w.\-/])")


def project_text_files():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in listed.splitlines():
        path = ROOT / name
        if path.suffix in TEXT_SUFFIXES and path.is_file() and path != pathlib.Path(__file__):
            yield path


def history_markers(text: str):
    found = [m.group(0) for pattern in HISTORY for m in pattern.finditer(text)]
    return found + [m.group(0) for m in HEX_ID.finditer(text)]


def test_no_development_history_in_project_files():
    offenders = {}
    for path in project_text_files():
        markers = history_markers(path.read_text(errors="replace"))
        if markers:
            offenders[str(path.relative_to(ROOT))] = markers[:5]
    assert not offenders, offenders


def test_the_history_check_sees_each_marker():
    for text in ("as issue 15 asked", "the fifth round of host work", "measured at stop 35",
                 "before (commit 79da86e)", "the code before 567ac4e, a worktree"):
        assert history_markers(text), text
    for text in ("round(x, 2)", "rounds K/V to bf16", "1.9875691500e-4f", "0x7fffffff", "sha256 of the file",
                 "tpu_executor/xla", "v5e-8", "1,024 rows"):
        assert not history_markers(text), text
