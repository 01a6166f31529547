"""The README is read in five minutes: at most 160 lines, short table cells, one line for every
command the CLI has, and none of the research controls that `--help` leaves out."""

from __future__ import annotations

import re

from paths import REPO

README = (REPO / "README.md").read_text(encoding="utf-8")
MAX_LINES = 160
MAX_CELL = 200
RESEARCH = ("--keep", "--keep-by", "--mismatched-sharer", "--sharer-notes", "--blend", "--blend-layer", "k2v4", "int2")


def test_readme_is_at_most_160_lines():
    lines = README.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; the limit is {MAX_LINES}"


def test_readme_table_cells_are_short():
    long = [cell[:60] for line in README.splitlines() if line.startswith("|")
            for cell in line.strip().strip("|").split(" | ") if len(cell.strip()) > MAX_CELL]
    assert not long, f"README.md table cells over {MAX_CELL} characters: {long}"


def test_readme_names_every_command_once_in_its_command_list():
    from typer.main import get_command

    from cachegraft_cli.cli.app import app

    commands = sorted(get_command(app).commands)  # type: ignore[attr-defined]  # a TyperGroup
    listed = re.findall(r"^- `cachegraft ([\w-]+)", README, re.M)
    assert sorted(listed) == commands


def test_readme_leaves_research_controls_to_the_docs():
    words = set(re.findall(r"[\w-]+", README))
    assert not words & set(RESEARCH), sorted(words & set(RESEARCH))
