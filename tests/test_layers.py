"""The package's layers import one way: pure pieces <- methods <- training <- export / eval /
analysis <- cli. Every import counts, also those inside functions (a lazy import is still a
dependency a reader has to follow)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import ssl_vit

ROOT = Path(ssl_vit.__file__).parent
# ``ssl_vit/__init__.py`` is the public face (``ssl_vit.load_backbone`` ...): it may name anything,
# and ``ssl_vit.__version__`` is a constant, not a dependency.

# The first part of a module's name below ``ssl_vit`` -> its layer.
LAYERS = {
    "__init__": 0, "io": 0, "runtime": 0, "errors": 0, "flops": 0,
    "backbones": 0, "losses": 0, "heads": 0, "masking": 0, "data": 0,
    "methods": 1,
    "training": 2,
    "export": 3, "eval": 3, "analysis": 3,
    "cli": 4, "bench": 4,
}


def _imports() -> dict[str, set[str]]:
    """Package part -> the package parts it imports (``ssl_vit.x.y`` counts as ``x``)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        part = rel.parts[0]
        if part == "__init__":
            continue
        package = [p for p in rel.parts[:-1]] if path.name != "__init__.py" else list(rel.parts[:-1])
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - node.level + 1]
                    names = [".".join(["ssl_vit", *base, *([node.module] if node.module else [])])]
                else:
                    names = [node.module or ""]
                if names[0] == "ssl_vit":  # from ssl_vit import x
                    names = [f"ssl_vit.{a.name}" for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "ssl_vit" and len(parts) > 1:
                    if parts[1] in LAYERS and parts[1] not in (part, "__init__"):
                        edges[part].add(parts[1])
    return edges


def test_every_part_of_the_package_has_a_layer():
    parts = {p.relative_to(ROOT).with_suffix("").parts[0] for p in ROOT.rglob("*.py")}
    assert parts - {"__main__"} <= set(LAYERS), f"give these a layer: {sorted(parts - set(LAYERS))}"


def test_imports_point_down_the_layers():
    upward = sorted(f"{a} -> {b}" for a, bs in _imports().items() for b in bs if LAYERS[b] > LAYERS[a])
    assert not upward, f"imports against the layers: {upward}"


def test_no_import_cycle_between_parts_of_the_package():
    edges = _imports()

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

    cycles = sorted(f"{a} <-> {b}" for a, bs in edges.items() for b in bs if a < b and reaches(b, a, {b}))
    assert not cycles, f"import cycles: {cycles}"
