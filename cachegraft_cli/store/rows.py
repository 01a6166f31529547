"""The passage table: `PassageRow`, and its per-segment columnar JSON form."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

INDEX_COLUMNS = ("id", "content_hash", "tokens", "offset", "parent_id", "chunk_index")
CONTENT_COLUMNS = ("title", "text", "metadata")


@dataclass
class PassageRow:
    """One passage (or one chunk of a long passage) and where its caches are.

    `tokens`, `segment` and `offset` are filled by the store: `offset` is the
    first token of the passage in its segment's arrays.
    """

    id: str
    title: str = ""
    text: str = ""
    content_hash: str = ""
    tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    parent_id: str | None = None
    chunk_index: int | None = None
    segment: str = ""
    offset: int = 0


def content_hash_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def index_columns(rows: list[PassageRow], checksums: list[dict]) -> dict:
    cols: dict[str, Any] = {name: [getattr(r, name) for r in rows] for name in INDEX_COLUMNS}
    cols["checksums"] = checksums
    return cols


def content_columns(rows: list[PassageRow]) -> dict:
    return {name: [getattr(r, name) for r in rows] for name in CONTENT_COLUMNS}


@dataclass
class SegmentTable:
    """The committed rows of one segment, as columns (cheap to load for 100k rows)."""

    segment: str
    index: dict
    content: dict | None = None

    def __len__(self) -> int:
        return len(self.index["id"])

    def span(self, i: int) -> tuple[int, int]:
        start = self.index["offset"][i]
        return start, start + self.index["tokens"][i]

    def checksum(self, i: int, kind: str) -> dict[str, int]:
        return self.index["checksums"][i][kind]

    def row(self, i: int) -> PassageRow:
        fields = {name: self.index[name][i] for name in INDEX_COLUMNS}
        if self.content is not None:
            fields.update({name: self.content[name][i] for name in CONTENT_COLUMNS})
        return PassageRow(segment=self.segment, **fields)
