"""No import cycle anywhere in polylane, deferred imports included.

Every module of every subpackage is parsed (not imported) and each `import` statement, at the top
or inside a function, is an edge to the polylane module it names; the graph must have no cycle.
A deferred import that closes a cycle only hides it from the interpreter, so it counts too. (A
submodule's implicit import of its parent package is not an edge: a package's `__init__` may
import its own submodules.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import polylane

SOURCE = Path(polylane.__file__).parent


def import_graph(package: Path, name: str) -> dict[str, set[str]]:
    """{module: the modules of the package it imports} for every module under `package` (named
    `name`)."""
    modules: dict[str, Path] = {}
    for path in package.rglob("*.py"):
        parts = [name, *path.relative_to(package).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                named = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            graph[module] |= {target for target in named if target in modules and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_polylane_has_no_import_cycle():
    graph = import_graph(SOURCE, "polylane")
    assert {"polylane.runtime.model.native.stack", "polylane.policy.kv.radix", "polylane.server.app"} <= set(
        graph
    )
    assert cycles(graph) == []


def test_a_cycle_through_a_deferred_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from pkg.sub import a\n    return a\n")
    (package / "c.py").write_text("import pkg.b\n")
    assert cycles(import_graph(package, "pkg")) == [["pkg.b", "pkg.sub.a"]]
