"""Every relative markdown link in README.md, benchmarks/README.md and docs/*.md resolves: the file
exists and, where the link names an anchor (`results.md#time-to-first-token`), the target file has a
heading whose GitHub anchor is that one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from paths import REPO

DOCS = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]+`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (letters, digits,
    `_`, `-` and spaces kept), each space a dash."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a markdown text; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def relative_links(text: str) -> list[str]:
    """Link targets outside code, without URLs that name a scheme (https:, mailto:)."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][\w+.-]*:", t)]


def dead_links(doc: Path) -> list[str]:
    dead = []
    for target in relative_links(doc.read_text(encoding="utf-8")):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            dead.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            dead.append(target)
    return dead


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_every_link_and_anchor_resolves(doc):
    dead = dead_links(doc)
    assert not dead, f"{doc.relative_to(REPO)} links to files or anchors that do not exist: {dead}"


def test_slugs_follow_github():
    assert slug("Time to first token") == "time-to-first-token"
    assert slug("Fewer stored tokens: `encode --keep R`") == "fewer-stored-tokens-encode---keep-r"
    assert slug("Passage assembly at k = 5") == "passage-assembly-at-k--5"
    assert slug("The transform codec's speed (2026-12-04)") == "the-transform-codecs-speed-2026-12-04"
    assert anchors("# A\n## A\n```\n# B\n```\n") == {"a", "a-1"}


def test_the_check_catches_a_dead_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part one\n", encoding="utf-8")
    doc = tmp_path / "b.md"
    doc.write_text("[ok](a.md#part-one) [self](#here) [gone](a.md#part-two) [file](c.md) `[code](x.md)`\n\n## Here\n",
                   encoding="utf-8")
    assert dead_links(doc) == ["a.md#part-two", "c.md"]
