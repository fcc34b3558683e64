"""The package's imports, drawn from its source: no module reaches into another's private names, and
the notebook bench (runs, notebooks, sessions, sweeps and what they share) has no import cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import qlab

PACKAGE = Path(qlab.__file__).resolve().parent
BENCH = {"qlab.notebooks", "qlab.session", "qlab.sweep", "qlab.runs", "qlab.paths", "qlab.lab", "qlab.cli"}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imports(name: str, path: Path, modules: dict) -> tuple[set[str], list[str]]:
    """(the qlab modules ``name`` imports, anywhere in the file; the private names it takes from others)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported, private = set(), []
    aliases = {}  # local name → module, for `from qlab import scaling` then `scaling._x`
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("qlab"):
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                target = full if full in modules else source
                if target in modules and target != name:
                    imported.add(target)
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif alias.name.startswith("_"):
                    private.append(f"{name} imports {source}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.name != name:
                    imported.add(alias.name)
                    aliases[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and module != name and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{name} reads {module}.{node.attr}")
    return imported, private


def _graph():
    modules = _modules()
    edges, private = {}, []
    for name, path in modules.items():
        edges[name], found = _imports(name, path, modules)
        private += found
    return edges, private


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in edges:
        if node not in index:
            visit(node)
    return groups


def test_no_module_takes_another_modules_private_names():
    _, private = _graph()
    assert not private, private


def test_the_notebook_bench_has_no_import_cycle():
    edges, _ = _graph()
    bench_cycles = [group for group in _cycles(edges) if set(group) & BENCH]
    assert not bench_cycles, bench_cycles


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
