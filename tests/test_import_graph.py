"""kvlab's import graph: no cycles, and no ``transformers`` below the integrations
(docs/design.md, "Model integration": the mechanisms are model-agnostic tensor code).

The graph is read from the sources with :mod:`ast`, nothing is imported: an edge ``a -> b``
for every ``import b`` / ``from b import x`` in module ``a`` — at module level, inside a
function (a lazy import still makes the two modules depend on each other) or under ``if
TYPE_CHECKING:`` (a type that only the checker imports is still a dependency: a cycle through
one is a contract in the wrong place). Relative imports are resolved against the importing
module's package; ``from pkg import name`` is an edge to the submodule ``pkg.name`` when there
is one, else to ``pkg``. The modules that PN-Mix's kernel table names (imported by name when a
kernel is first chosen, as a backend registry does) are edges of the dispatch module too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: Packages and modules that must not import ``transformers``, directly or through the kvlab
#: modules they import (only :mod:`kvlab.integrations` adapts to it).
NO_TRANSFORMERS = ("kvlab.relay", "kvlab.pnmix", "kvlab.rope", "kvlab.backends", "kvlab.native")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module under ``src/kvlab``: dotted name -> (file, is a package)."""
    out = {}
    for path in sorted((SRC / "kvlab").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, package)
    return out


def _imports(node: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node`` (``if TYPE_CHECKING:`` bodies included)."""
    return [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(kvlab edges: module -> kvlab modules it imports, external: module -> the top-level
    names of the other packages it imports)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    external: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        edges: set[str] = set()
        others: set[str] = set()
        for stmt in _imports(ast.parse(path.read_text("utf-8"), filename=str(path))):
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.name in modules:
                        edges.add(alias.name)
                    elif alias.name.split(".")[0] == "kvlab":
                        raise AssertionError(f"{name} imports a missing module {alias.name}")
                    else:
                        others.add(alias.name.split(".")[0])
                continue
            if stmt.level:  # relative: against this module's package
                base = name.split(".") if package else name.split(".")[:-1]
                base = base[: len(base) - (stmt.level - 1)]
                target = ".".join([*base, *([stmt.module] if stmt.module else [])])
            else:
                target = stmt.module or ""
            for alias in stmt.names:
                if f"{target}.{alias.name}" in modules:
                    edges.add(f"{target}.{alias.name}")
                elif target in modules:
                    edges.add(target)
                elif target.split(".")[0] == "kvlab":
                    raise AssertionError(f"{name} imports from a missing module {target}")
                else:
                    others.add(target.split(".")[0])
        edges.discard(name)
        graph[name] = edges
        external[name] = others
    graph[DISPATCH] |= set(_kernel_table_modules())
    return graph, external


#: The module whose kernel table names modules to import (kvlab.pnmix.kernels.dispatch.KERNELS).
DISPATCH = "kvlab.pnmix.kernels.dispatch"


def _kernel_table_modules() -> list[str]:
    """The ``module="..."`` strings of the kernel table's entries, read from the source."""
    path = SRC / (DISPATCH.replace(".", "/") + ".py")
    names = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "KernelEntry":
            for kw in node.keywords:
                if kw.arg == "module" and isinstance(kw.value, ast.Constant):
                    names.append(kw.value.value)
    return names


def _cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], set[str]]]:
    """Each strongly connected component of more than one module (the modules that are on a
    cycle together), with one shortest cycle from its first module (``[a, b, ..., a]``),
    sorted by that cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan (the graph is small: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        # shortest way back to start inside the component (breadth first)
        parent: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            step = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w == start:
                        found = v
                        break
                    if w not in parent:
                        parent[w] = v
                        step.append(w)
                if found is not None:
                    break
            frontier = step
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append(([*reversed(path), start], component))
    return sorted(cycles, key=lambda pair: pair[0])


def test_the_graph_reader_resolves_what_it_should():
    graph, external = _graph()
    # from-imports of submodules, relative imports, and a lazy import inside a function
    assert "kvlab.backends" in graph["kvlab.relay.attention"]  # from kvlab import backends
    assert "kvlab.relay.kernels.cpu" in graph["kvlab.relay.attention"]
    assert "kvlab.backends" in graph["kvlab.cli"]  # inside reproduce()
    assert "torch" in external["kvlab.native"]
    assert "transformers" in external["kvlab.integrations.layer"]
    # if TYPE_CHECKING: imports count
    assert "kvlab.relay.storage" in graph["kvlab.relay.kernels.cpu"]
    # the kernel table's modules (imported by name) are the dispatch module's edges
    table = set(_kernel_table_modules())
    assert table == {
        "kvlab.pnmix.kernels.cpu",
        "kvlab.pnmix.kernels.triton_splitk",
        "kvlab.pnmix.kernels.triton_decode",
    }
    assert table <= graph[DISPATCH] and table <= set(graph)


def test_no_import_cycles():
    graph, _ = _graph()
    lines = []
    for cycle, members in _cycles(graph):
        edges = sorted(f"{a} -> {b}" for a in members for b in graph[a] & members)
        lines.append("  " + " -> ".join(cycle))
        if len(edges) > len(cycle) - 1:  # more than this cycle: every edge among them
            lines += [f"      {edge}" for edge in edges]
    assert not lines, "import cycles (move what both need to a module below both):\n" + "\n".join(
        lines
    )


def test_the_mechanisms_do_not_import_transformers():
    graph, external = _graph()
    problems = []
    for root in sorted(graph):
        if not any(root == p or root.startswith(p + ".") for p in NO_TRANSFORMERS):
            continue
        parent: dict[str, str] = {root: root}
        todo = [root]
        while todo:
            v = todo.pop()
            for w in sorted(graph[v]):
                if w not in parent:
                    parent[w] = v
                    todo.append(w)
        for module in sorted(parent):
            if "transformers" in external[module]:
                chain = [module]
                while chain[-1] != root:
                    chain.append(parent[chain[-1]])
                problems.append(" <- ".join(chain))
    assert not problems, "transformers imported below kvlab.integrations:\n" + "\n".join(
        "  " + p for p in problems
    )
