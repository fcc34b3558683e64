"""The package's imports, drawn from its source (every import statement, at the top or inside a
function, and every ``importlib.import_module("qlab...")``): no module reaches into another's private
names, no cycle anywhere, and no import runs back up the layers — foundation, the reference numerics,
the kernels (the fast paths), models and training, the notebook bench. The only references back up
are the deprecated aliases (a module's ``__getattr__`` that warns and hands out a moved name), each
listed in ``DEPRECATED_ALIASES``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import qlab

PACKAGE = Path(qlab.__file__).resolve().parent
# lowest first; a module may import its own layer and those below (subpackages inherit their layer)
LAYERS = {
    "foundation": {
        "qlab", "qlab.checks", "qlab.paths", "qlab.ops", "qlab.host", "qlab.results", "qlab.compat",
        "qlab.stats",
    },
    "reference numerics": {
        "qlab.formats", "qlab.scaling", "qlab.quantize", "qlab.numerics", "qlab.synthetic",
    },
    "kernels": {"qlab.kernels"},
    "models and training": {
        "qlab.recipe", "qlab.nn", "qlab.probes", "qlab.sparse", "qlab.ablation", "qlab.seed_model",
        "qlab.models", "qlab.advisor", "qlab.plan", "qlab.train",
    },
    "notebook bench": {
        "qlab.session", "qlab.notebooks", "qlab.sweep", "qlab.runs", "qlab.lab", "qlab.cli", "qlab.plotting",
        "qlab.claims", "qlab.crossmachine", "qlab.campaign", "qlab.run_lists",
    },
}  # fmt: skip
# names moved up a layer, still reachable at their old place with a DeprecationWarning
DEPRECATED_ALIASES = {("qlab.formats", "qlab.kernels.noise"), ("qlab.quantize", "qlab.kernels.compiled")}


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
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            target = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else ""
            if target in modules and target != name:
                imported.add(target)
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


def _aliases(name: str, path: Path, modules: dict) -> set[str]:
    """The modules a module's deprecated aliases point to: the values of its ``MOVED`` table, which its
    ``__getattr__`` hands to ``qlab.compat.moved``."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MOVED" for t in node.targets):
            found |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
    return {target for target in found if target in modules}


def _layer(module: str) -> int:
    for index, members in enumerate(LAYERS.values()):
        if any(module == member or module.startswith(member + ".") for member in members - {"qlab"}):
            return index
    return 0 if module == "qlab" else -1


def test_every_module_has_a_layer():
    assert not [name for name in _modules() if _layer(name) < 0]


def test_no_import_runs_back_up_a_layer_but_the_deprecated_aliases():
    modules = _modules()
    edges, _ = _graph()
    aliases = {(name, target) for name, path in modules.items() for target in _aliases(name, path, modules)}
    assert aliases == DEPRECATED_ALIASES
    upward = [
        f"{name} ({list(LAYERS)[_layer(name)]}) imports {target} ({list(LAYERS)[_layer(target)]})"
        for name, targets in edges.items()
        for target in targets
        if _layer(target) > _layer(name) and (name, target) not in DEPRECATED_ALIASES
    ]
    assert not upward, upward


def test_the_package_has_no_import_cycle():
    edges, _ = _graph()
    without_aliases = {
        name: targets - {t for n, t in DEPRECATED_ALIASES if n == name} for name, targets in edges.items()
    }
    assert _cycles(without_aliases) == []


def test_the_reference_reads_no_kernel_and_says_so_nowhere():
    """The old workaround comment ("not at the top: qlab.kernels imports this module") is gone with
    the cycle it excused."""
    for path in PACKAGE.rglob("*.py"):
        assert "imports this module" not in path.read_text(), path


def test_no_module_takes_another_modules_private_names():
    _, private = _graph()
    assert not private, private


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_readme_and_the_architecture_page_name_every_module_in_its_layer():
    """The README's Layout and docs/architecture.md's table list the layers above: every module, in
    the layer it is tested in (a module added here and not there fails)."""
    readme = (PACKAGE.parent / "README.md").read_text(encoding="utf-8")
    layout = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| ([a-z ]+) \| (.+) \|$", page, flags=re.MULTILINE))
    for layer, members in LAYERS.items():
        names = {m.removeprefix("qlab.") for m in members if m != "qlab"}
        row = rows[layer]
        assert not [n for n in names if not re.search(rf"\b{n}\b", row)], (layer, row)
        assert not [n for n in names if f"`{n}`" not in layout and f"`{n}/`" not in layout], layer
