"""The package layout the architecture relies on: no import cycle between mmserve's packages,
and the engines reach the router's concepts only through `kv/`."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "components" / "src" / "mmserve"


def _imports() -> dict[str, set[str]]:
    """Top-level package (or module) -> the other mmserve packages it imports, lazily or not."""
    edges: dict[str, set[str]] = {}
    for source in PACKAGE.rglob("*.py"):
        owner = source.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "mmserve" and len(parts) > 1 and parts[1] not in (owner, "_mm"):
                    edges.setdefault(owner, set()).add(parts[1])
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    pending, seen = list(edges.get(start, ())), set()
    while pending:
        node = pending.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            pending.extend(edges.get(node, ()))
    return False


def test_no_import_cycle_between_packages() -> None:
    edges = _imports()
    assert "engines" in edges and "router" in edges  # the scan sees the packages
    cycles = sorted(
        (a, b) for a, targets in edges.items() for b in targets if _reaches(edges, b, a)
    )
    assert not cycles, f"packages that import each other: {cycles}"


def test_engines_do_not_import_the_router() -> None:
    assert "router" not in _imports()["engines"]
