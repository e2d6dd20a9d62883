"""The queue's modules import in one direction: no circle, not even one kept for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

SPOOL = Path(__file__).parents[1] / "celeris_cli" / "spool"


def imports() -> dict[str, set[str]]:
    deps: dict[str, set[str]] = {}
    for f in SPOOL.glob("*.py"):
        found = deps.setdefault(f.stem, set())
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
    return deps


def test_spool_has_no_import_circle() -> None:
    deps = imports()
    for start in deps:
        stack = [(start, [start])]
        while stack:
            mod, path = stack.pop()
            for dep in deps.get(mod, set()):
                assert dep != start, f"import circle: {' -> '.join(path + [dep])}"
                if dep not in path:
                    stack.append((dep, path + [dep]))
