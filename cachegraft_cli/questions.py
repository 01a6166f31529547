"""Batch questions: a JSONL file (or stdin) of {"id", "question"} objects, read and checked
whole before any model loads."""

from __future__ import annotations

import json
import sys
from typing import IO, Iterable

from cachegraft_cli.errors import UsageError

_SHAPE = 'Each line must look like {"id": "q1", "question": "..."}.'


def read_questions(source: str) -> list[tuple[object, str]]:
    """(id, question) pairs from a JSONL file, or from stdin for `-`; an id defaults to the line number."""
    if source == "-":
        return parse_questions(sys.stdin, "<stdin>")
    try:
        with open(source, encoding="utf-8") as stream:
            return parse_questions(stream, source)
    except OSError as exc:
        raise UsageError(f"Cannot read questions file {source}: {exc.strerror}.", "Check the path.") from None


def parse_questions(lines: Iterable[str] | IO[str], name: str) -> list[tuple[object, str]]:
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            question = item["question"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{name}:{n}: expected a JSON object with a \"question\" field.", _SHAPE) from None
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"{name}:{n}: the question is empty or not a string.", _SHAPE)
        items.append((item.get("id", n), question))
    return items
