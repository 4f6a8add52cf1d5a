"""Import direction equals data direction: pallas_kernels <- models <- tpu_executor.
The shared pure-Python parts (scheduler, KV-cache manager, requests, detokenizer) import no torch."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {"pallas_kernels": set(), "models": {"pallas_kernels"}, "tpu_executor": {"pallas_kernels", "models"}}
PURE_PYTHON = ["tpu_executor/scheduler.py", "tpu_executor/kv_cache_manager.py",
               "tpu_executor/request.py", "tpu_executor/detokenizer.py", "tpu_executor/sampling_params.py"]


def imported_modules(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_packages_import_only_downstream(package):
    for path in (ROOT / package).rglob("*.py"):
        for module in imported_modules(path):
            head = module.split(".")[0]
            assert head not in ALLOWED or head == package or head in ALLOWED[package], \
                f"{path.relative_to(ROOT)} imports {module}"
            assert head != "scripts", f"{path.relative_to(ROOT)} imports scripts"


@pytest.mark.parametrize("relative", PURE_PYTHON)
def test_shared_core_is_pure_python(relative):
    for module in imported_modules(ROOT / relative):
        assert module.split(".")[0] not in ("torch", "torch_xla", "jax", "numpy"), f"{relative} imports {module}"
