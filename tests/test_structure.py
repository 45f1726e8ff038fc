"""The package's shape (docs/design.md, "The tree" and "Layers"): imports between its packages
flow one way (no cycle), and no module grows past a size a reader takes in at once. Static
(the source's AST): nothing is imported."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "dtensor_ring"
MAX_LINES = 600


def _package_of(module: str) -> str:
    """``dtensor_ring.a.b`` -> ``a`` (the top-level package or module it belongs to)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> dict[str, set[str]]:
    """Top-level package -> the top-level packages it imports (relative or absolute)."""
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("dtensor_ring"):
                target = node.module
            else:
                continue
            a, b = _package_of(module), _package_of(target)
            if a != b and b != "__init__":
                edges.setdefault(a, set()).add(b)
    return edges


def test_no_package_cycle():
    edges = _imports()
    assert edges["layouts"] == {"parts"}  # the analysis sees imports at all
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != "open", f"import cycle: {' -> '.join([*path, nxt])}"
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_module_sizes():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert sizes["algorithm.py"] > 50  # the count sees the modules
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"
