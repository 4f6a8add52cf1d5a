"""Import direction equals data direction, and these tests are where the rules live.

The project installs one package, ``tpu_executor``; the repository's top-level ``models/`` and
``pallas_kernels/`` folders install as ``tpu_executor.models`` and ``tpu_executor.kernels``
(setup.py), so nothing may import them by their folder names (a user's ``models/`` folder
would shadow them). The units, bottom up:

    kernels < models < core < worker < executor < engine < tools < entrypoints < tuning < bench < cli

A module imports its own unit or lower ones, never one above it (so the worker never imports
the engine, and the engine no command). ``kernels`` imports nothing else of the project,
``models`` only the kernels, and ``core`` is pure Python: nothing else of the project and no
torch (nor torch_xla, jax, numpy, ray). ``cli.py`` is the composition root: it routes to every
command and nothing imports it but ``scripts/``. Inside the package nothing imports the
package root's lazy names (``from tpu_executor import LLM`` hides an upward import). Only the
executor package's factory imports the Ray executor, lazily; ray itself is imported at a
module's top only there and in the replicated server's Ray Serve modules, which the serve
command imports lazily. No two modules import each other, directly or round a longer circle,
lazily or not, inside a unit as across units.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Repository folder -> installed package name.
FOLDERS = {"tpu_executor": "tpu_executor", "models": "tpu_executor.models", "pallas_kernels": "tpu_executor.kernels"}
UNITS = ["kernels", "models", "core", "worker", "executor", "engine", "tools", "entrypoints", "tuning", "bench",
         "cli"]
ONLY = {"kernels": {"kernels"}, "models": {"kernels", "models"}, "core": {"core"}}
HEAVY = ("torch", "torch_xla", "jax", "numpy", "ray")


def project_files():
    """(path, installed module name) of every module the project installs."""
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            yield path, ".".join((package,) + parts)


def imported_modules(path: pathlib.Path, top_level_only: bool = False):
    """Absolute module names ``path`` imports (``top_level_only``: not inside functions)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def unit_of(module: str) -> str:
    """The unit of a project module ("" for the package root, None outside the project)."""
    parts = module.split(".")
    if parts[0] != "tpu_executor":
        return None
    if len(parts) == 1:
        return ""
    assert parts[1] in UNITS, f"{module} is in no unit: add it to UNITS"
    return parts[1]


def import_graph():
    """Project module -> the project modules it imports (anywhere in it); ``from a import b``
    points at ``a.b`` where that is a module."""
    modules = {module: path for path, module in project_files()}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                            for a in node.names}
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def circles(graph):
    """The modules of each import circle (strongly connected groups of two or more)."""
    reach = {}

    def reachable(start):
        if start not in reach:
            seen, todo = set(), [start]
            while todo:
                for nxt in graph[todo.pop()] - seen:
                    seen.add(nxt)
                    todo.append(nxt)
            reach[start] = seen
        return reach[start]

    groups = {frozenset({m} | {o for o in reachable(m) if m in reachable(o)}) for m in graph if m in reachable(m)}
    return sorted(sorted(group) for group in groups)


def test_no_module_circles():
    assert circles(import_graph()) == []


def test_a_planted_circle_inside_one_unit_is_found():
    graph = import_graph()
    serve, app = "tpu_executor.entrypoints.serve", "tpu_executor.entrypoints.ray_serve.app"
    assert app in graph[serve]  # the serve command starts the replicated server (lazily)
    graph[app] = graph[app] | {serve}
    assert circles(graph) == [sorted([serve, app])]


def test_every_module_belongs_to_a_unit():
    units = {unit_of(module) for _, module in project_files()}
    assert units == set(UNITS) | {""}, units


@pytest.mark.parametrize("unit", UNITS)
def test_units_import_only_downwards(unit):
    files = [(path, module) for path, module in project_files() if unit_of(module) == unit]
    assert files, f"unit {unit} has no modules"
    for path, module in files:
        for imported in imported_modules(path):
            other = unit_of(imported)
            where = f"{path.relative_to(ROOT)} ({unit}) imports {imported}"
            if other is None:
                continue
            assert other != "", f"{where}: import from the module that defines the name"
            assert UNITS.index(other) <= UNITS.index(unit), f"{where}, a unit above it"
            assert unit not in ONLY or other in ONLY[unit], f"{where}; {unit} may import only {ONLY[unit]}"


def test_nothing_imports_the_folders_by_their_own_names():
    paths = [path for path, _ in project_files()] + sorted((ROOT / "tests").rglob("*.py")) + \
        sorted((ROOT / "scripts").rglob("*.py"))
    for path in paths:
        for imported in imported_modules(path):
            folder = imported.split(".")[0]
            assert folder not in ("models", "pallas_kernels"), f"{path.relative_to(ROOT)} imports {imported}"


def test_core_is_pure_python():
    for path, module in project_files():
        if unit_of(module) == "core":
            for imported in imported_modules(path):
                assert imported.split(".")[0] not in HEAVY, f"{path.relative_to(ROOT)} imports {imported}"


# The replicated server's modules are Ray Serve code through and through (a request router
# subclasses Serve's): they import ray at the top, and everything else imports them lazily.
SERVE_MODULES = {f"tpu_executor.entrypoints.ray_serve.{name}" for name in ("routing", "replicas", "app")}


def test_only_the_factory_imports_ray_and_lazily():
    executor = ROOT / "tpu_executor" / "executor"
    for path, module in project_files():
        if not module.startswith("tpu_executor.") or module.split(".")[1] in ("models", "kernels"):
            continue
        top = set(imported_modules(path, top_level_only=True))
        assert "tpu_executor.executor.ray_executor" not in top, f"{path.relative_to(ROOT)} imports the Ray executor"
        if module not in SERVE_MODULES:
            assert not top & SERVE_MODULES, f"{path.relative_to(ROOT)} imports the Ray Serve modules at its top"
        if path.name != "ray_executor.py" and module not in SERVE_MODULES:
            assert not {m for m in top if m.split(".")[0] == "ray"}, f"{path.relative_to(ROOT)} imports ray"
    lazy = [p.relative_to(ROOT) for p in (ROOT / "tpu_executor").rglob("*.py")
            if "tpu_executor.executor.ray_executor" in set(imported_modules(p))]
    assert lazy == [(executor / "__init__.py").relative_to(ROOT)], lazy
