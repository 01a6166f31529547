"""The READMEs and docs/*.md name only repository paths that exist: files and folders under the
repository's top-level folders (in prose, code spans and code blocks), package-relative paths in
code spans (`store/recover.py` is `cachegraft_cli/store/recover.py`), and relative markdown links."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from paths import REPO

DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TOP = ("cachegraft_cli", "tests", "benchmarks", "docs", "sample_data", ".ci")
PACKAGE = REPO / "cachegraft_cli"
# a path-like word: segments of word characters, dots, dashes, `*` and `<...>` placeholders
PATH = re.compile(r"(?<![\w./$<-])(?:\.ci|[\w-]+)(?:/[\w.*<>+-]*)+")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)


def _exists(root: Path, path: str) -> bool:
    """Whether `path` (relative to `root`) exists; `*`, `<name>` and an all-caps segment (`NAME`)
    stand for any one name, and must match at least one."""
    parts = ["*" if "*" in p or p.startswith("<") or (p.isupper() and p.isalpha()) else p
             for p in path.split("/") if p]
    if "*" not in parts:
        return (root / path).exists()
    return any(root.glob("/".join(parts)))


def named_paths(text: str) -> list[tuple[str, Path]]:
    """(path as written, the folder it is relative to) for every repository path the text names."""
    found = []
    for word in PATH.findall(text):
        if word.split("/")[0] in TOP and "..." not in word:  # `tests/...` stands for a folder's files
            found.append((word.rstrip(".,:;"), REPO))
    for span in CODE.findall(text):
        if span.startswith("```"):
            continue
        for word in PATH.findall(span):
            first = word.split("/")[0]
            if first not in TOP and (PACKAGE / first).is_dir() and (word.endswith((".py", "/"))):
                found.append((word, PACKAGE))
    return found


def links(text: str) -> list[str]:
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][\w+.-]*:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_named_path_exists(doc):
    text = doc.read_text(encoding="utf-8")
    dead = sorted({w for w, root in named_paths(text) if not _exists(root, w)})
    dead += sorted({t for t in links(text) if not (doc.parent / t).exists()})
    assert not dead, f"{doc.relative_to(REPO)} names paths that do not exist: {dead}"


def test_the_walk_finds_paths_and_catches_dead_ones():
    """The checker itself: it sees each form of path, and a dead one fails."""
    text = ("See tests/store/store_suite.py and `python benchmarks/run_all.py`, the package's `store/recover.py`, "
            "[the format](docs/store-format.md) and `cachegraft_cli/fuser/builtin/NAME/TRAINING.md`.\n"
            "```bash\npython benchmarks/gone.py\n```\n`store/nothing.py`, [gone](docs/gone.md), "
            "`segments/<name>/rows.bin`, s3://bucket/tests/x, `tests/...`")
    got = {w: _exists(root, w) for w, root in named_paths(text)}
    assert got == {"tests/store/store_suite.py": True, "benchmarks/run_all.py": True, "store/recover.py": True,
                   "docs/store-format.md": True, "cachegraft_cli/fuser/builtin/NAME/TRAINING.md": True,
                   "benchmarks/gone.py": False, "store/nothing.py": False, "docs/gone.md": False}
    assert links(text) == ["docs/store-format.md", "docs/gone.md"]
    assert not (REPO / "docs/gone.md").exists()
