"""Batch questions for `ask --questions`: a JSONL file (or stdin) of {"id": ..., "question": "..."}.

Read and checked whole before any model loads: a bad line fails with
`FILE:LINE: what is wrong`, never half-way through a batch.
"""

from __future__ import annotations

import json
import sys
from typing import IO

from cachegraft_cli.checks import location, unusable_character
from cachegraft_cli.errors import UsageError

_UTF8_HINT = "Write the file as UTF-8 text, without \\ud800-\\udfff escapes that do not pair up."
_HINT = 'Each line must be a JSON object like {"id": "q1", "question": "..."}.'


def read_questions(source: str, stdin: IO | None = None) -> list[tuple[str | int, str]]:
    """(id, question) per non-blank line; `-` reads stdin. The id defaults to the line number."""
    location("questions file (--questions)", source)  # a NUL in the path: a UsageError, not open()'s ValueError
    if source == "-":
        stream = stdin if stdin is not None else sys.stdin
        return parse_questions(getattr(stream, "buffer", stream).read(), "<stdin>")
    try:
        with open(source, "rb") as fh:
            data = fh.read()
    except IsADirectoryError:
        raise UsageError(f"questions file {source} is a directory.", "Pass a JSONL file.") from None
    except OSError as exc:
        raise UsageError(f"Cannot read questions file {source}: {exc.strerror}.", "Check the path.") from None
    return parse_questions(data, source)


def parse_questions(data: bytes | str, where: str) -> list[tuple[str | int, str]]:
    """Parse a questions file's content (raises `UsageError` naming `where` and the line)."""
    if isinstance(data, bytes):
        data = _decode(data, where)
    items = []
    for n, line in enumerate(data.removeprefix("\ufeff").splitlines(), 1):
        if line.strip():
            items.append(_item(line, where, n))
    if not items:
        raise UsageError(f"{where}: no questions in it.", _HINT)
    return items


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise UsageError(f"{where}:{line}: not UTF-8 (byte 0x{data[err.start]:02x}).",
                         "Re-save the file as UTF-8.") from None


def _item(line: str, where: str, n: int) -> tuple[str | int, str]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}:{n}: malformed JSON ({err.msg}, column {err.colno}).", _HINT) from None
    if not isinstance(item, dict):
        raise UsageError(f"{where}:{n}: expected a JSON object, got a JSON {_kind(item)}.", _HINT)
    question = item.get("question")
    if not isinstance(question, str):
        what = "has no \"question\" field" if question is None else f"has a {_kind(question)} as \"question\""
        raise UsageError(f"{where}:{n}: the object {what}; it must be a string.", _HINT)
    if not question.strip():
        raise UsageError(f"{where}:{n}: the question is empty.", _HINT)
    qid = item.get("id", n)
    if not isinstance(qid, (str, int)) or isinstance(qid, bool):
        raise UsageError(f"{where}:{n}: \"id\" must be a string or a whole number, not a {_kind(qid)}.", _HINT)
    for field, value in (("question", question), ("id", qid)):
        # a JSON escape such as "\ud800" (or stdin read with surrogateescape) parses to text that no
        # tokenizer or JSON output can take: refused here, naming the line, before any model loads
        problem = unusable_character(value) if isinstance(value, str) else None
        if problem:
            raise UsageError(f"{where}:{n}: the {field} holds {problem}.", _UTF8_HINT)
    return qid, question


def _kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)
