"""Import direction equals data direction, and these tests are where the rules live.

Between packages: pallas_kernels <- models <- tpu_executor; scripts/ import the packages,
never the reverse. Inside tpu_executor, the layers from the bottom up are
core < worker < executor < engine < tools < entrypoints: a module imports its own layer or
lower ones, never one above it (so the worker never imports the engine or the entry points).
core/ is pure Python: no torch (nor torch_xla, jax, numpy, ray) and nothing else of the
project. Only the executor package's factory imports the Ray executor, lazily.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"pallas_kernels": set(), "models": {"pallas_kernels"}, "tpu_executor": {"pallas_kernels", "models"}}
LAYERS = ["core", "worker", "executor", "engine", "tools", "entrypoints"]
HEAVY = ("torch", "torch_xla", "jax", "numpy", "ray")


def imported_modules(path: pathlib.Path, top_level_only: bool = False):
    """Absolute module names ``path`` imports (``top_level_only``: not inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "tpu_executor" else ""


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_packages_import_only_downstream(package):
    for path in (ROOT / package).rglob("*.py"):
        for module in imported_modules(path):
            head = module.split(".")[0]
            assert head not in PACKAGES or head == package or head in PACKAGES[package], \
                f"{path.relative_to(ROOT)} imports {module}"
            assert head != "scripts", f"{path.relative_to(ROOT)} imports scripts"


@pytest.mark.parametrize("layer", LAYERS)
def test_layers_never_import_upwards(layer):
    files = list((ROOT / "tpu_executor" / layer).rglob("*.py"))
    assert files, f"tpu_executor/{layer} is missing"
    for path in files:
        for module in imported_modules(path):
            other = layer_of(module)
            assert other == "" or other not in LAYERS or LAYERS.index(other) <= LAYERS.index(layer), \
                f"{path.relative_to(ROOT)} ({layer}) imports {module} ({other}), a layer above it"


def test_core_is_pure_python_and_self_contained():
    for path in (ROOT / "tpu_executor" / "core").rglob("*.py"):
        for module in imported_modules(path):
            head = module.split(".")[0]
            assert head not in HEAVY, f"{path.relative_to(ROOT)} imports {module}"
            assert head not in PACKAGES or layer_of(module) == "core", f"{path.relative_to(ROOT)} imports {module}"


def test_only_the_factory_imports_ray_and_lazily():
    executor = ROOT / "tpu_executor" / "executor"
    for path in (ROOT / "tpu_executor").rglob("*.py"):
        top = set(imported_modules(path, top_level_only=True))
        assert "tpu_executor.executor.ray_executor" not in top, f"{path.relative_to(ROOT)} imports the Ray executor"
        if path.name != "ray_executor.py":
            assert not {m for m in top if m.split(".")[0] == "ray"}, f"{path.relative_to(ROOT)} imports ray"
    lazy = [p.relative_to(ROOT) for p in (ROOT / "tpu_executor").rglob("*.py")
            if "tpu_executor.executor.ray_executor" in set(imported_modules(p))]
    assert lazy == [(executor / "__init__.py").relative_to(ROOT)], lazy
