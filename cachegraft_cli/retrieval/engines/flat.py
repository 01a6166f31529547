"""Exact vector search: a float32 matrix per segment, memory-mapped, scored by brute force.

The reference every approximate engine is measured against, and the right
choice for small corpora: at 100k passages of 384 dimensions a query reads
150 MB; at 10M it would read 15 GB (docs/results.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cachegraft_cli.retrieval.engines.base import Ranked
from cachegraft_cli.retrieval.engines.segments import SegmentedVectors

SCORE_BLOCK = 1 << 24  # scores held at once (queries x segment rows): 64 MB


def exact_search(rows: np.ndarray, vectors: np.ndarray, queries: np.ndarray, count: int) -> list[Ranked]:
    """The best `count` rows per query by brute-force dot products over a segment's float32 `vectors`."""
    count = min(count, len(rows))
    out: list[Ranked] = []
    step = max(1, SCORE_BLOCK // max(len(rows), 1))
    for lo in range(0, len(queries), step):
        scores = queries[lo:lo + step] @ vectors.T
        for row_scores in scores:
            top = np.argpartition(-row_scores, count - 1)[:count] if count < len(rows) else np.arange(len(rows))
            out.append((np.asarray(rows[top], np.int64), row_scores[top].astype(np.float32)))
    return out


class FlatEngine(SegmentedVectors):
    name = "flat"
    exact = True

    def write_segment(self, path: Path, rows: np.ndarray, vectors: np.ndarray) -> None:
        np.save(path / "vectors.npy", vectors.astype(np.float32, copy=False))

    def open_segment(self, path: Path, rows: np.ndarray) -> Any:
        return np.load(path / "vectors.npy", mmap_mode="r", allow_pickle=False)

    def search_segment(self, handle: Any, rows: np.ndarray, queries: np.ndarray, count: int) -> list[Ranked]:
        return exact_search(rows, handle, queries, count)

    def segment_vectors(self, handle: Any, rows: np.ndarray) -> np.ndarray:
        return np.asarray(handle, np.float32)
