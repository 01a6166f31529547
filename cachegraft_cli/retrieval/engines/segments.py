"""Vector engines as immutable segments, so appends cost what they append.

    <root>/segments.json          {"dim": d, "segments": [{"name", "rows"}]}: replaced atomically, last
    <root>/<name>/rows.npy        int64 rows of the segment, ascending
    <root>/<name>/...             the engine's own files for those vectors

A commit writes one new segment of the rows put since the last one. A row
put again (a replaced passage) lives in the newest segment holding it; older
copies are dead: searched past (each segment is asked for k plus its dead
rows) and dropped when their segment is merged. Merging is tiered, like
Lucene's: when MERGE_FACTOR segments share a size tier (powers of
MERGE_FACTOR rows) they are rebuilt as one, so every vector is rebuilt
O(log(rows)) times over the life of the index and a single append rebuilds
nothing it did not add, except when it completes a tier.
"""

from __future__ import annotations

import json
import math
import shutil
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cachegraft_cli.retrieval.engines.base import VECTORS, Engine, Ranked, empty_ranked

MANIFEST = "segments.json"
MERGE_FACTOR = 8


@dataclass
class Segment:
    name: str
    rows: np.ndarray  # int64, global rows, ascending (a vector's position is searchsorted(rows, row))
    handle: Any  # what the engine searches
    dead: int = 0  # rows here that a newer segment holds


class SegmentedVectors(Engine):
    """The segment bookkeeping; subclasses say how one segment is built, opened and searched."""

    takes = VECTORS

    def __init__(self, root: Path, params: dict[str, Any]):
        super().__init__(root, params)
        self.dim: int | None = params.get("dim")
        self.segments: list[Segment] = []
        self._pending_rows: list[int] = []
        self._pending: list[np.ndarray] = []
        self._owner = np.zeros(0, np.int32)  # segment index holding each row's live copy
        self._count = 0  # rows, pending ones included

    # ------------------------------------------------------------ engine hooks

    @abstractmethod
    def write_segment(self, path: Path, rows: np.ndarray, vectors: np.ndarray) -> None:
        """Write the files of one segment (`path` exists, rows.npy is written by the caller)."""

    @abstractmethod
    def open_segment(self, path: Path, rows: np.ndarray) -> Any:
        """A searchable handle on a written segment (memory-mapped where the engine can)."""

    @abstractmethod
    def search_segment(self, handle: Any, rows: np.ndarray, queries: np.ndarray, count: int) -> list[Ranked]:
        """Best `count` (global row, cosine) per query within one segment."""

    @abstractmethod
    def segment_vectors(self, handle: Any, rows: np.ndarray) -> np.ndarray:
        """The segment's vectors as float32, in the order of `rows` (for merges)."""

    # ------------------------------------------------------------ Engine

    @classmethod
    def create(cls, root: Path, **options: Any) -> SegmentedVectors:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        engine = cls(root, {**cls.default_params(), **options, "dim": None})
        engine._write_manifest()
        return engine

    @classmethod
    def open(cls, root: Path, params: dict[str, Any]) -> SegmentedVectors:
        engine = cls(Path(root), params)
        manifest = json.loads((engine.root / MANIFEST).read_text())
        engine.dim = manifest["dim"]
        for entry in manifest["segments"]:
            rows = np.load(engine.root / entry["name"] / "rows.npy", mmap_mode="r", allow_pickle=False)
            engine.segments.append(Segment(entry["name"], rows, engine.open_segment(engine.root / entry["name"], rows)))
        engine._reown()
        return engine

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {}

    @property
    def rows(self) -> int:
        return self._count

    def put(self, rows: Sequence[int], items: np.ndarray) -> None:
        vectors = np.ascontiguousarray(items, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(rows):
            raise ValueError(f"expected {len(rows)} vectors as an (n, dim) array, got shape {vectors.shape}")
        if self.dim is None:
            self.dim = int(vectors.shape[1])
        if vectors.shape[1] != self.dim:
            raise ValueError(f"{vectors.shape[1]}-dim vectors for a {self.dim}-dim engine")
        self.check_new_rows(rows)
        self._pending_rows.extend(int(r) for r in rows)
        self._pending.append(vectors)
        self._count = max(self._count, max((int(r) + 1 for r in rows), default=0))

    def commit(self) -> dict[str, Any]:
        if self._pending_rows:
            rows, vectors = self._take_pending()
            self.segments.append(self._build(rows, vectors))
            self._reown()
            self._merge_tiers()
            self._write_manifest()
            self._remove_unlisted()
        self.params["dim"] = self.dim
        return dict(self.params)

    def search(self, queries: np.ndarray, k: int) -> list[Ranked]:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if k < 1 or not self.segments or not len(queries):
            return [empty_ranked() for _ in range(len(queries))]
        if queries.shape[1] != self.dim:
            raise ValueError(f"{queries.shape[1]}-dim queries for a {self.dim}-dim engine")
        found: list[list[Ranked]] = [[] for _ in range(len(queries))]
        for number, seg in enumerate(self.segments):
            for q, (rows, scores) in enumerate(self.search_segment(seg.handle, seg.rows, queries, k + seg.dead)):
                live = self._owner[rows] == number if seg.dead else slice(None)
                found[q].append((rows[live], scores[live]))
        return [_best(parts, k) for parts in found]

    # ------------------------------------------------------------ segments

    def _take_pending(self) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(self._pending_rows, np.int64)
        vectors = np.concatenate(self._pending)
        self._pending_rows, self._pending = [], []
        last = {int(r): i for i, r in enumerate(rows)}  # a row put twice: its last vector
        keep = np.fromiter(sorted(last.values()), np.int64, count=len(last))
        return rows[keep], vectors[keep]

    def _build(self, rows: np.ndarray, vectors: np.ndarray) -> Segment:
        order = np.argsort(rows, kind="stable")
        rows, vectors = rows[order], vectors[order]
        name = f"seg-{uuid.uuid4().hex[:12]}"
        path = self.root / name
        path.mkdir()
        self.write_segment(path, rows, vectors)
        np.save(path / "rows.npy", rows)
        return Segment(name, rows, self.open_segment(path, rows))

    def _reown(self) -> None:
        n = max((int(s.rows.max()) + 1 for s in self.segments if len(s.rows)), default=0)
        owner = np.full(n, -1, np.int32)
        for number, seg in enumerate(self.segments):
            owner[seg.rows] = number
        for number, seg in enumerate(self.segments):
            seg.dead = int(np.count_nonzero(owner[seg.rows] != number))
        self._owner = owner
        self._count = max(self._count, n)

    def _merge_tiers(self) -> None:
        while True:
            tiers: dict[int, list[int]] = {}
            for number, seg in enumerate(self.segments):
                tiers.setdefault(_tier(len(seg.rows) - seg.dead), []).append(number)
            full = [numbers for numbers in tiers.values() if len(numbers) >= MERGE_FACTOR]
            if not full:
                return
            self._merge(full[0])

    def _merge(self, numbers: list[int]) -> None:
        """Rebuild segments `numbers` as one (their live rows), placed last: live rows
        are in exactly one segment, so the order of the others is unaffected."""
        parts_rows, parts_vectors = [], []
        for number in numbers:
            seg = self.segments[number]
            live = self._owner[seg.rows] == number
            parts_rows.append(np.asarray(seg.rows)[live])
            parts_vectors.append(self.segment_vectors(seg.handle, seg.rows)[live])
        merged = self._build(np.concatenate(parts_rows), np.concatenate(parts_vectors))
        self.segments = [s for i, s in enumerate(self.segments) if i not in set(numbers)] + [merged]
        self._reown()

    def _write_manifest(self) -> None:
        manifest = {"dim": self.dim, "segments": [{"name": s.name, "rows": len(s.rows)} for s in self.segments]}
        tmp = self.root / f"{MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(manifest))
        tmp.replace(self.root / MANIFEST)

    def _remove_unlisted(self) -> None:
        """Segments merged away, or left by a commit that died before its manifest."""
        listed = {s.name for s in self.segments}
        for path in self.root.iterdir():
            if path.is_dir() and path.name.startswith("seg-") and path.name not in listed:
                shutil.rmtree(path, ignore_errors=True)


def _tier(rows: int) -> int:
    return int(math.log(max(rows, 1), MERGE_FACTOR))


def _best(parts: list[Ranked], k: int) -> Ranked:
    """Top k over per-segment results (ties: lower row first)."""
    if not parts:
        return empty_ranked()
    rows = np.concatenate([p[0] for p in parts]).astype(np.int64)
    scores = np.concatenate([p[1] for p in parts]).astype(np.float32)
    order = np.lexsort((rows, -scores))[:k]
    return rows[order], scores[order]
