"""Approximate vector search: one usearch HNSW graph per segment, memory-mapped on open.

usearch keeps each segment in one file (graph + vectors) that opens as a view
(no parse, no copy), stores vectors as int8 or float16, and takes the rows as
its keys. The graph's int8 scores only pick candidates (4x k, at least k + 32):
they are rescored from a float32 copy of the vectors (`vectors.npy`,
memory-mapped; only the candidates' pages are read), which also makes merges
lossless. Defaults: int8 vectors in the graph (a quarter of float32), 16 links per node,
expansion 128 when adding and 1024 when searching: on the benchmark's 130k
rows (SQuAD among Gaussian distractors) 512 found 99.0% of the exact top 5 and
lost 0.7 points of SQuAD recall@5, 1024 found 99.6% and lost 0.3, at twice
the query time (docs/results.md, "Retrieval").

A segment of at most `EXACT_ROWS` rows is scored exactly against all its float32
vectors instead: the graph of a small segment (a fresh append) can leave a node
unreachable, so that a query equal to a stored vector missed its own row (4 of
600 such queries over 40 builds of 60 rows, with the graph built on two
threads), and scoring a few thousand rows costs less than the graph search.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from cachegraft_cli.retrieval.engines.base import Ranked
from cachegraft_cli.retrieval.engines.flat import exact_search
from cachegraft_cli.retrieval.engines.segments import SegmentedVectors

FILE = "hnsw.usearch"
VECTORS = "vectors.npy"  # float32, in the order of rows.npy: rescoring is exact
DTYPES = ("i8", "f16", "f32")
EXACT_ROWS = 4096  # segments this small are scored exactly (see the module docstring)


def thread_count() -> int:
    """Threads for building and searching a graph. Two-thread builds are faster but depend on
    thread timing: the same rows can give slightly different graphs (tests pin one thread)."""
    return max(1, min(2, os.cpu_count() or 1))


class UsearchEngine(SegmentedVectors):
    name = "usearch"
    exact = False

    @classmethod
    def default_params(cls) -> dict[str, Any]:
        return {"dtype": "i8", "connectivity": 16, "expansion_add": 128, "expansion_search": 1024}

    def __init__(self, root: Path, params: dict[str, Any]):
        params = {**self.default_params(), **params}
        if params["dtype"] not in DTYPES:
            raise ValueError(f"usearch dtype {params['dtype']!r} is not one of {', '.join(DTYPES)}")
        super().__init__(root, params)

    def write_segment(self, path: Path, rows: np.ndarray, vectors: np.ndarray) -> None:
        from usearch.index import Index

        index = Index(ndim=vectors.shape[1], metric="cos", dtype=self.params["dtype"],
                      connectivity=self.params["connectivity"], expansion_add=self.params["expansion_add"],
                      expansion_search=self.params["expansion_search"])
        index.add(rows.astype(np.uint64), vectors, threads=thread_count())
        index.save(str(path / FILE))
        np.save(path / VECTORS, vectors.astype(np.float32, copy=False))

    def open_segment(self, path: Path, rows: np.ndarray) -> Any:
        from usearch.index import Index

        index: Any = Index.restore(str(path / FILE), view=True)
        if index is None:
            raise ValueError(f"{path / FILE} is not a usearch index")
        index.expansion_search = self.params["expansion_search"]  # not kept in the file
        return index, np.load(path / VECTORS, mmap_mode="r", allow_pickle=False)

    def search_segment(self, handle: Any, rows: np.ndarray, queries: np.ndarray, count: int) -> list[Ranked]:
        graph, vectors = handle
        count = min(count, len(rows))
        if len(rows) <= EXACT_ROWS:
            return exact_search(rows, vectors, queries, count)
        matches = graph.search(queries, min(len(rows), max(4 * count, count + 32)), threads=thread_count())
        keys = np.atleast_2d(matches.keys).astype(np.int64)
        # one query comes back as `Matches` (already cut to what was found), several as `BatchMatches`
        counts = np.atleast_1d(np.asarray(getattr(matches, "counts", keys.shape[1])))
        out = []
        for q in range(len(queries)):
            found = keys[q, :counts[q]]
            scores = np.asarray(vectors[np.searchsorted(rows, found)], np.float32) @ queries[q]
            best = np.lexsort((found, -scores))[:count]
            out.append((found[best], scores[best]))
        return out

    def segment_vectors(self, handle: Any, rows: np.ndarray) -> np.ndarray:
        return np.asarray(handle[1], np.float32)
