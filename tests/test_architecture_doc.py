"""docs/ARCHITECTURE.md matches the tree. Its table of what each package imports is the import
graph (`ast`, lazy imports included). It names every module of the package: each `.py` file under cachegraft_cli/
appears in its module map (the "Packages" section), by its path (`store/recover.py`) or, in the row of its package
(`store/`), by its path inside that package (`writer.py`). A package's `__init__.py` is named by its
folder; the root's `__init__.py` and `__main__.py` are named themselves."""

from __future__ import annotations

import ast
import re

from paths import PACKAGE, REPO

DOC = REPO / "docs" / "ARCHITECTURE.md"
CODE = re.compile(r"`([^`\n]+)`")


def rows(text: str) -> list[tuple[list[str], set[str]]]:
    """(the package folders a table row is about, every code span in the row) for each table row."""
    out = []
    for line in text.splitlines():
        if not line.startswith("|"):
            continue
        cells = line.split("|")
        keys = [k for k in CODE.findall(cells[1]) if k.endswith("/")]
        out.append((keys, set(CODE.findall(line))))
    return out


def unnamed(text: str) -> list[str]:
    spans = set(CODE.findall(text))
    table = rows(text)

    def named(rel: str) -> bool:
        return rel in spans or any(rel.startswith(k) and rel[len(k):] in found for keys, found in table for k in keys)

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if path.name == "__init__.py" and path.parent != PACKAGE:
            rel = rel.removesuffix("__init__.py")  # the package itself: `store/`, or `ray/` in `encoding/`'s row
        if not named(rel):
            missing.append(rel)
    return missing


def module_map(text: str) -> str:
    """The "Packages" section, where the module map is."""
    start = text.index("## Packages")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_module_is_in_the_module_map():
    missing = unnamed(module_map(DOC.read_text(encoding="utf-8")))
    assert not missing, f"docs/ARCHITECTURE.md does not name these modules of cachegraft_cli/: {missing}"


def test_the_check_sees_rows_and_paths():
    text = ("| `store/` | `store.py` (the store), `writer.py` |\n"
            "| `store/recover.py` | recovery |\n")
    got = unnamed(text)
    assert "store/store.py" not in got and "store/recover.py" not in got and "store/" not in got
    assert "store/lock.py" in got and "lm/models.py" in got


def imported_packages() -> dict[str, set[str]]:
    """{package or root module: the others it imports}, errors left out, from the source."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if len(rel) == 1 and path.stem in ("__init__", "__main__"):
            continue
        unit = rel[0].removesuffix(".py")
        found = graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == PACKAGE.name:  # from cachegraft_cli import config
                found.update(a.name for a in node.names if (PACKAGE / a.name).exists()
                             or (PACKAGE / f"{a.name}.py").exists())
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE.name + "."):
                found.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                found.update(a.name.split(".")[1] for a in node.names if a.name.startswith(PACKAGE.name + "."))
        found.discard(unit)
        found.discard("errors")
    return graph


def documented_imports(text: str) -> dict[str, set[str]]:
    """The "What each imports" table: {package: the packages its row names}."""
    start = text.index("| package | imports |")
    out = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        packages, imports = (cell.strip() for cell in line.strip("|").split("|"))
        names = {n.strip() for n in re.sub(r"\([^)]*\)", "", imports).split(",")}
        for package in packages.split(", "):
            out[package] = set() if names & {"only errors", "nothing"} else names
    return out


def test_the_import_table_is_the_import_graph():
    assert documented_imports(DOC.read_text(encoding="utf-8")) == imported_packages()
