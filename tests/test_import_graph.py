"""accel's modules import each other without cycles, counting imports inside functions (lazy imports too), and so
do its top-level packages and modules (`accel.wire`, `accel.state`, `accel.collectives`, ...) taken as wholes: the
layers of the tree (the wire below the process state, HF's operations above it) are the import graph's.

The graph is read from the source (AST), not from `sys.modules`, so an import that only runs on some path
counts. An edge goes from a module to every module it imports and to the packages (`__init__.py`) that import
runs on the way, except its own ancestors (already imported when it runs). `importlib.import_module("accel...")`
with a literal name counts as an import; imports under `if TYPE_CHECKING:` do not (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "accel"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _is_type_checking_block(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    pending = [tree]
    while pending:
        node = pending.pop()
        yield node
        if _is_type_checking_block(node):
            pending.extend(node.orelse)
            continue
        pending.extend(ast.iter_child_nodes(node))


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names `module` imports (a `from X import Y` gives X.Y, which may be a module or an attribute)."""
    names = set()
    is_package = path.name == "__init__.py"
    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("import_module")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            names.add(node.args[0].value)
    return {name for name in names if name == "accel" or name.startswith("accel.")}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph() -> dict[str, set[str]]:
    """module -> the accel modules importing it runs (its own ancestors left out)."""
    modules = all_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        own = set(_ancestors(module))
        targets = set()
        for name in imported_names(module, path):
            for candidate in [*_ancestors(name), name]:
                if candidate in modules and candidate not in own and candidate != module:
                    targets.add(candidate)
        graph[module] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components with more than one module (each holds at least one cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _one_cycle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first module of `component` (to name in the failure)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return paths[node] + [start]
                if target not in paths:
                    paths[target] = paths[node] + [target]
                    following.append(target)
        frontier = following
    return [start]


def test_graph_sees_lazy_imports_packages_and_import_module(tmp_path, monkeypatch):
    package = tmp_path / "accel"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from accel.sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (package / "c.py").write_text(
        "import importlib\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import accel.d\n"
        "def g():\n    return importlib.import_module('accel.sub.b')\n"
    )
    (package / "d.py").write_text("")
    monkeypatch.setattr(f"{__name__}.ROOT", package)
    graph = import_graph()
    assert graph == {
        "accel": set(),
        "accel.sub": {"accel.sub.b"},
        "accel.sub.b": {"accel.c"},
        "accel.c": {"accel.sub", "accel.sub.b"},
        "accel.d": set(),
    }
    assert strongly_connected(graph) == [{"accel.sub", "accel.sub.b", "accel.c"}]


def test_finds_a_planted_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_accel_has_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100 and graph["accel.state"]  # the real package, read
    cycles = strongly_connected(graph)
    described = [" -> ".join(_one_cycle(graph, component)) + f"  (all of: {sorted(component)})" for component in cycles]
    assert not cycles, "import cycles in accel/:\n" + "\n".join(described)


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with every module merged into its top-level package or module (`accel.wire.padding` ->
    `accel.wire`); `accel` itself (its `__init__` names everything lazily) is left out."""
    merged: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module == "accel":
            continue
        source = ".".join(module.split(".")[:2])
        merged.setdefault(source, set()).update(
            ".".join(target.split(".")[:2]) for target in targets if target != "accel"
        )
        merged[source].discard(source)
    return merged


def test_package_graph_merges_modules_into_top_level_packages():
    graph = {"accel": {"accel.a"}, "accel.a.x": {"accel.b", "accel.a.y"}, "accel.a.y": set(), "accel.b": {"accel"}}
    assert package_graph(graph) == {"accel.a": {"accel.b"}, "accel.b": set()}
    assert strongly_connected(package_graph({**graph, "accel.b": {"accel.a.y"}})) == [{"accel.a", "accel.b"}]


def test_accels_top_level_packages_have_no_import_cycles():
    graph = package_graph(import_graph())
    assert {"accel.wire", "accel.state", "accel.collectives", "accel.backends"} <= set(graph)
    assert "accel.state" in graph["accel.collectives"] and "accel.wire" in graph["accel.state"]  # the layers, read
    cycles = strongly_connected(graph)
    described = [" -> ".join(_one_cycle(graph, component)) + f"  (all of: {sorted(component)})" for component in cycles]
    assert not cycles, "import cycles between accel's top-level packages:\n" + "\n".join(described)
