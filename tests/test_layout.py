"""The package's layout: the library imports no application, and no module
imports itself back (module-level and lazy imports, read from the source).

docs/design.md draws the graph this test holds the code to.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torchani_fast"

# The old import paths of modules that moved (each is the moved module itself):
# they import what they stand for, and nothing imports them.
ALIASES = {"torchani_fast.ase", "torchani_fast.cli", "torchani_fast.screen", "torchani_fast.evaluate", "torchani_fast.lammps",
           "torchani_fast.batched", "torchani_fast.batched_md", "torchani_fast.torchsim",
           "torchani_fast.openmm", "torchani_fast.openmm.force", "torchani_fast.openmm.mlpotential",
           "torchani_fast.openmm.torchforce"}
FACE = "torchani_fast"  # the package's __init__: the public names, the library's and the applications'


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set) -> set:
    """The package modules that ``path`` imports, anywhere in its body."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # "from . import x" may name a submodule x
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph():
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths) | {"torchani_fast._C"}  # (the compiled ops: a module of their own)
    return {name: _imports(path, modules) - {"torchani_fast._C"} for name, path in paths.items()}


def _is_app(name: str) -> bool:
    return name == "torchani_fast.apps" or name.startswith("torchani_fast.apps.")


def test_the_library_imports_no_application(graph):
    library = [m for m in graph if not _is_app(m) and m not in ALIASES and m != FACE]
    assert "torchani_fast.core" in library and "torchani_fast.apps.cli" in graph
    offending = {m: sorted(t for t in graph[m] if _is_app(t) or t in ALIASES or t == FACE) for m in library}
    assert {m: t for m, t in offending.items() if t} == {}


def test_nothing_imports_the_old_paths_or_the_face(graph):
    users = {m: sorted(t for t in graph[m] if t in ALIASES or t == FACE) for m in graph
             if m not in ALIASES and m != FACE}
    assert {m: t for m, t in users.items() if t} == {}


def test_the_import_graph_is_acyclic(graph):
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
