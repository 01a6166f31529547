"""The passage table: `PassageRow`, and its per-segment forms on disk.

Format 2 stores keep each segment's index columns in `rows.bin`: raw arrays
behind a small JSON header, opened as zero-copy numpy views without a Python
object per row, so opening a 100k-passage store does not parse 100k rows.
Ids are one NUL-separated UTF-8 blob (one `split` at load). Format 1 stores keep columnar JSON (`rows.json`) and
are still read, and appended to, in that form.

A pruned store (`encode --keep R`) adds three columns: `kept` (every stored token's
position in its passage, row after row), `kept_start` (each row's first entry in
`kept`) and `span_tokens` (the passage's token count before pruning). A table of
unpruned rows has none of them, so `--keep 1` writes the same bytes as before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachegraft_cli.errors import StoreCorruptError, UsageError
from cachegraft_cli.store.packed import join_strings, pack_arrays, split_strings, unpack_arrays

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
    positions: list[int] | None = None  # pruned: the stored tokens' positions in the passage (else 0..tokens-1)
    span_tokens: int | None = None  # pruned: the passage's token count before pruning

    @property
    def pruned(self) -> bool:
        return self.positions is not None

    @property
    def read_text(self) -> str:
        """The text the stored caches were computed from, and the one `text` systems read: the
        passage, and after it the sharer's notes where `encode --sharer-notes` wrote some."""
        return with_notes(self.text, (self.metadata or {}).get(NOTES_KEY))


NOTES_KEY = "sharer_notes"  # a row's metadata key for its sharer notes (`encoding.notes`)


def with_notes(text: str, notes: str | None) -> str:
    """A passage's text with its notes after it (unchanged without notes)."""
    return f"{text}\n\nNotes:\n{notes}" if notes else text


def content_hash_of(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def content_columns(rows: list[PassageRow]) -> dict:
    return {name: [getattr(r, name) for r in rows] for name in CONTENT_COLUMNS}


@dataclass
class SegmentTable:
    """The committed rows of one segment, as columns.

    `hashes` is a bytes (`S`) array and `crcs` a (rows, kinds x components) array
    named by `crc_columns` ("kind/component"): strings and dicts are only made
    for the rows a caller asks about.
    """

    segment: str
    ids: list[str]
    hashes: np.ndarray
    tokens: np.ndarray
    offsets: np.ndarray
    parents: list[str | None]
    chunk_index: np.ndarray  # -1: not a chunk
    crc_columns: list[str]
    crcs: np.ndarray
    content: dict | None = None
    kept: np.ndarray | None = None  # pruned rows: int32 positions of every stored token, row after row
    kept_start: np.ndarray | None = None  # each row's first entry in `kept`
    span_tokens: np.ndarray | None = None  # each row's passage length before pruning

    @property
    def pruned(self) -> bool:
        return self.kept is not None

    def positions(self, i: int) -> np.ndarray | None:
        """Row `i`'s stored tokens' positions in its passage; None for an unpruned table (0..tokens-1)."""
        if self.kept is None or self.kept_start is None:
            return None
        start = int(self.kept_start[i])
        return self.kept[start:start + int(self.tokens[i])]

    def __len__(self) -> int:
        return len(self.ids)

    def span(self, i: int) -> tuple[int, int]:
        start = int(self.offsets[i])
        return start, start + int(self.tokens[i])

    def content_hash(self, i: int) -> str:
        return self.hashes[i].decode("ascii")

    def checksum(self, i: int, kind: str) -> dict[str, int]:
        prefix = kind + "/"
        return {col[len(prefix):]: int(v) for col, v in zip(self.crc_columns, self.crcs[i]) if col.startswith(prefix)}

    def row(self, i: int) -> PassageRow:
        chunk = int(self.chunk_index[i])
        fields: dict[str, Any] = dict(id=self.ids[i], content_hash=self.content_hash(i), tokens=int(self.tokens[i]),
                      offset=int(self.offsets[i]), parent_id=self.parents[i], chunk_index=None if chunk < 0 else chunk)
        if self.content is not None:
            fields.update({name: self.content[name][i] for name in CONTENT_COLUMNS})
        kept = self.positions(i)
        if kept is not None and self.span_tokens is not None:
            fields.update(positions=kept.tolist(), span_tokens=int(self.span_tokens[i]))
        return PassageRow(segment=self.segment, **fields)


# ---------------------------------------------------------------- building from rows


def build_table(segment: str, rows: list[PassageRow], crcs: list[dict]) -> SegmentTable:
    """The table of rows a writer has just committed (`crcs`: {kind: {component: crc}} per row)."""
    columns, matrix = _crc_matrix(crcs)
    table = SegmentTable(
        segment, [r.id for r in rows], np.array([r.content_hash for r in rows], dtype="S"),
        np.array([r.tokens for r in rows], dtype=np.int64), np.array([r.offset for r in rows], dtype=np.int64),
        [r.parent_id for r in rows], np.array([-1 if r.chunk_index is None else r.chunk_index for r in rows], np.int64),
        columns, matrix)
    return with_positions(table, rows)


def with_positions(table: SegmentTable, rows: list[PassageRow]) -> SegmentTable:
    """`table` with the pruned rows' positions columns; unchanged when no row is pruned.
    A segment is pruned as a whole or not at all (a store never mixes the two)."""
    pruned = [r.pruned for r in rows]
    if not any(pruned):
        return table
    if not all(pruned):
        raise StoreCorruptError(f"segment {table.segment}: some rows are pruned and some are not.",
                                hint="Encode pruned and unpruned passages into separate stores.")
    for r in rows:
        _check_positions(r)
    lengths = np.array([len(r.positions or []) for r in rows], dtype=np.int64)
    table.kept = np.concatenate([np.asarray(r.positions, dtype=np.int32) for r in rows])
    table.kept_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    table.span_tokens = np.array([r.span_tokens for r in rows], dtype=np.int64)
    return table


def _check_positions(row: PassageRow) -> None:
    kept = np.asarray(row.positions, dtype=np.int64)
    span = row.span_tokens or 0
    if len(kept) != row.tokens or not len(kept) or np.any(np.diff(kept) <= 0) or kept[0] < 0 or kept[-1] >= span:
        raise UsageError(f"passage {row.id!r}: kept positions must be {row.tokens} increasing positions below its "
                         f"{span} tokens.")


def _crc_matrix(crcs: list[dict]) -> tuple[list[str], np.ndarray]:
    """[{kind: {component: crc}}] per row -> ("kind/component" names, (rows, names) uint32)."""
    columns = [f"{kind}/{comp}" for kind, comps in (crcs[0] if crcs else {}).items() for comp in comps]
    pairs = [col.split("/", 1) for col in columns]
    values = [[c[kind][comp] for kind, comp in pairs] for c in crcs]
    return columns, np.array(values, dtype=np.uint32).reshape(len(crcs), len(columns))


# ---------------------------------------------------------------- format 2: rows.bin

def table_to_bin(table: SegmentTable) -> bytes:
    has_parent = np.array([p is not None for p in table.parents], dtype=bool)
    names = np.frombuffer(json.dumps(table.crc_columns).encode(), dtype=np.uint8)
    arrays = {
        "id": join_strings(table.ids, "id"), "content_hash": table.hashes, "tokens": table.tokens,
        "offset": table.offsets, "parent_id": join_strings([p or "" for p in table.parents], "parent id"),
        "has_parent": has_parent, "chunk_index": table.chunk_index, "crcs": table.crcs, "crc_columns": names}
    if table.kept is not None and table.kept_start is not None and table.span_tokens is not None:
        # appended only for a pruned table: an unpruned one keeps its old bytes
        arrays.update(kept=table.kept, kept_start=table.kept_start, span_tokens=table.span_tokens)
    return pack_arrays(arrays)


def table_from_bin(segment: str, blob: bytes) -> SegmentTable:
    a = unpack_arrays(blob)
    n = len(a["tokens"])
    if a["has_parent"].any():
        parents = [p if has else None for p, has in zip(split_strings(a["parent_id"], n), a["has_parent"].tolist())]
    else:
        parents = [None] * n
    return SegmentTable(segment, split_strings(a["id"], n), a["content_hash"], a["tokens"], a["offset"], parents,
                        a["chunk_index"], json.loads(a["crc_columns"].tobytes()), a["crcs"],
                        kept=a.get("kept"), kept_start=a.get("kept_start"), span_tokens=a.get("span_tokens"))


# ---------------------------------------------------------------- format 1: rows.json


def table_to_json(table: SegmentTable) -> dict:
    kinds = dict.fromkeys(col.split("/", 1)[0] for col in table.crc_columns)  # ordered, unique
    crcs = [{kind: table.checksum(i, kind) for kind in kinds} for i in range(len(table))]
    rows = [table.row(i) for i in range(len(table))]
    columns = {**{name: [getattr(r, name) for r in rows] for name in INDEX_COLUMNS}, "checksums": crcs}
    if table.pruned:
        columns.update(positions=[r.positions for r in rows], span_tokens=[r.span_tokens for r in rows])
    return {"columns": columns}


def table_from_json(segment: str, blob: bytes) -> SegmentTable:
    cols = json.loads(blob)["columns"]
    columns, matrix = _crc_matrix(cols["checksums"])
    table = SegmentTable(
        segment, list(cols["id"]), np.array(cols["content_hash"], dtype="S"),
        np.array(cols["tokens"], dtype=np.int64).reshape(-1), np.array(cols["offset"], dtype=np.int64).reshape(-1),
        list(cols["parent_id"]), np.array([-1 if c is None else c for c in cols["chunk_index"]], np.int64).reshape(-1),
        columns, matrix)
    if "positions" not in cols:
        return table
    rows = [PassageRow(i, tokens=int(n), positions=p, span_tokens=s) for i, n, p, s in
            zip(table.ids, table.tokens, cols["positions"], cols["span_tokens"])]
    return with_positions(table, rows)


def parse_table(segment: str, file: str, blob: bytes) -> SegmentTable:
    try:
        return table_from_bin(segment, blob) if file.endswith(".bin") else table_from_json(segment, blob)
    except (ValueError, KeyError, OSError, UnicodeDecodeError) as exc:
        raise StoreCorruptError(f"segment {segment}: {file} is unreadable ({exc}).",
                                hint="Run `cachegraft store verify` for details.") from None


def carry_kept(table: SegmentTable, sources: list[tuple[SegmentTable, list[int]]]) -> SegmentTable:
    """`table` (built from rows of `sources`, in that order: compaction merges tables, repair keeps a
    subset) with those rows' kept positions; unchanged when the sources are unpruned."""
    if not any(src.pruned for src, _ in sources):
        return table
    if not all(src.pruned for src, _ in sources):
        raise StoreCorruptError(f"segment {table.segment}: pruned and unpruned rows cannot share a segment.",
                                hint="Run `cachegraft store verify`; a store never mixes the two.")
    positions = [src.positions(i) for src, rows in sources for i in rows]
    spans = [int(src.span_tokens[i]) for src, rows in sources for i in rows]  # type: ignore[index]
    lengths = np.array([len(p) for p in positions if p is not None], dtype=np.int64)
    table.kept = np.concatenate([p for p in positions if p is not None]).astype(np.int32)
    table.kept_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    table.span_tokens = np.array(spans, dtype=np.int64)
    return table
