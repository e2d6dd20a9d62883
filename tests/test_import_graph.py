"""The package's modules import one another without a circle, counting the imports made inside functions too (a
lazy import that only hides a circle is still one), and the settings do not reach up into the decoders' packages."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "celeris_cli"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    """Each module's imports of the package's modules, wherever in the module they are written (a copy)."""
    return {name: set(targets) for name, targets in _read().items()}


@functools.cache
def _read() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name and t != "celeris_cli"}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    group.append(x)
                    if x == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_package_imports_without_a_circle() -> None:
    graph = _graph()
    assert "celeris_cli.arch.memory_sizes" in graph["celeris_cli.arch.canvas_memory"]  # the graph sees imports
    assert _circles(graph) == []


def test_a_circle_is_found_where_there_is_one() -> None:
    graph = _graph()
    graph["celeris_cli.arch.memory_sizes"].add("celeris_cli.arch.canvas_memory")  # as memory <-> canvas_memory was
    assert _circles(graph) == [["celeris_cli.arch.canvas_memory", "celeris_cli.arch.memory_sizes"]]


def test_the_settings_do_not_import_the_decoders_packages() -> None:
    reach: set[str] = set()
    todo = ["celeris_cli.params"]
    graph = _graph()
    while todo:
        for m in graph[todo.pop()] - reach:
            reach.add(m)
            todo.append(m)
    for package in ("celeris_cli.structured", "celeris_cli.decode", "celeris_cli.arch"):
        assert not any(m == package or m.startswith(package + ".") for m in reach), package
