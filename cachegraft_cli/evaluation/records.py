"""Append-only JSONL record files, keyed, so an interrupted run can resume."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

from cachegraft_cli.errors import CacheGraftError

ANSWER_KEY = ("benchmark", "id", "system", "k")
VERDICT_KEY = ("benchmark", "id", "system", "k", "judge")
PAIR_KEY = ("benchmark", "id", "a", "b", "k", "judge")


class RecordFile:
    """A JSONL file of records with a unique key; appends are flushed one by one.

    A torn last line (the process died mid-write) is cut off on open; a record
    written twice keeps its last copy.
    """

    def __init__(self, path: Path, key_fields: tuple[str, ...]):
        self.path, self.key_fields = Path(path), key_fields
        self._records: dict[tuple, dict] = {}
        if self.path.exists():
            self._load()
        self._fh: IO[str] | None = None

    def key(self, record: dict) -> tuple:
        return tuple(record[f] for f in self.key_fields)

    def __contains__(self, key: tuple) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def append(self, record: dict) -> None:
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n")
        self._fh.flush()
        self._records[self.key(record)] = record

    def records(self) -> list[dict]:
        """All records in canonical (key-sorted) order."""
        return [self._records[k] for k in sorted(self._records)]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            with open(self.path, "r+b") as fh:  # drop the torn tail
                fh.truncate(len(complete))
        for line_no, line in enumerate(complete.decode("utf-8").splitlines(), 1):
            if line.strip():
                record = _parse(line, self.path, line_no)
                self._records[self.key(record)] = record


def _parse(line: str, path: Path, line_no: int) -> dict:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise CacheGraftError(f"{path}:{line_no} is not valid JSON.",
                              "The run directory is damaged; remove that line or start a new run.") from None


def read_records(path: Path, key_fields: tuple[str, ...]) -> list[dict]:
    """Canonical-order records of a file, or [] when it does not exist."""
    if not os.path.exists(path):
        return []
    return RecordFile(path, key_fields).records()
