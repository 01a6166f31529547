"""One meaning per name, checked over the source with `ast` (no module is imported).

No two top-level classes of the package share a name, and the names that once meant two
things (a corpus passage and a training passage, an asker's prepared question and a training
run's set-up, ...) are each defined once. Functions in general may share names across
modules (`check`, `main`); these ones may not.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from paths import PACKAGE

# Each meant two things in two modules; now each is defined in one module only.
ONCE = ("Passage", "Prepared", "check_question", "ask_options", "add_notes")


def top_level_definitions() -> dict[str, dict[str, list[str]]]:
    """{"class" | "other": {name: [module path, ...]}} for the package's module-level definitions."""
    found: dict[str, dict[str, list[str]]] = {"class": defaultdict(list), "other": defaultdict(list)}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.parse(path.read_text(encoding="utf-8"), filename=where).body:
            for name, kind in _defined(node):
                found[kind][name].append(where)
    return found


def _defined(node: ast.stmt) -> list[tuple[str, str]]:
    if isinstance(node, ast.ClassDef):
        return [(node.name, "class")]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [(node.name, "other")]
    if isinstance(node, ast.Assign):
        return [(t.id, "other") for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [(node.target.id, "other")]
    return []


def test_no_two_classes_share_a_name():
    classes = top_level_definitions()["class"]
    shared = {name: paths for name, paths in classes.items() if len(paths) > 1}
    assert not shared, f"classes defined in more than one module (rename one): {shared}"


def test_names_that_meant_two_things_are_defined_once():
    found = top_level_definitions()
    for name in ONCE:
        paths = found["class"].get(name, []) + found["other"].get(name, [])
        assert len(paths) <= 1, f"{name} is defined in {paths}: one name, one thing (rename one)"


def test_the_checks_see_the_package():
    """Guards the guard: a wrong PACKAGE path would make both tests above pass vacuously."""
    found = top_level_definitions()
    assert found["class"]["Passage"] == ["cachegraft_cli/corpus.py"]
    assert Path(PACKAGE / "serving" / "worker.py").exists()
    assert len(found["class"]) > 50
