"""The house plan, checked over the source with `ast` (no module is imported).

Every import of the package, lazy ones inside functions included, goes down the
floors of `FLOORS` (a module may import its own component or a lower floor), the
import graph has no cycle, and the package root holds at most `MAX_ROOT` modules.
docs/ARCHITECTURE.md draws the same floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

from paths import PACKAGE

# Lowest floor first. A component is a root module or a subpackage.
FLOORS = [
    "errors",
    "checks",
    "config",
    "progress",
    "corpus",
    "store",
    "lm",
    "fuser",
    "session",
    "retrieval",
    "encoding",
    "answering",
    "maintenance",
    "evaluation",
    "training",
    "serving",
    "api",
    "cli",
]
MAX_ROOT = 10
NAME = PACKAGE.name


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, at any depth of its code."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def component(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # the package itself re-exports the API
    return "cli" if parts[1] == "__main__" else parts[1]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    scc.append(member)
                    if member == node:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(graph()) == []


def test_cycles_are_found():
    """The check itself: a made-up two-module loop and a self-contained chain."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_every_import_goes_down_the_floors():
    edges = graph()
    unknown = sorted({component(m) for m in edges} - set(FLOORS))
    assert not unknown, f"components without a floor: {unknown}; add them to FLOORS and docs/ARCHITECTURE.md"
    upward = sorted(
        f"{src} -> {dst}"
        for src, targets in edges.items()
        for dst in targets
        if component(src) != component(dst) and FLOORS.index(component(dst)) > FLOORS.index(component(src))
    )
    assert upward == []


def test_the_package_root_stays_small():
    root = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(root) <= MAX_ROOT, root


def test_the_architecture_doc_names_every_floor():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    missing = [floor for floor in FLOORS if f"`{floor}" not in text]
    assert missing == []
