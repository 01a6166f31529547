"""The one interface every retrieval engine implements.

An engine holds *rows* 0..rows-1, each a list of terms (lexical engines) or a
normalised float32 vector (vector engines); the retrieval index above it maps
rows to passage ids, tokenises and embeds. An engine lives in one local
directory that it owns; `commit` makes what was `put` durable there and
searchable. Every engine passes the same test suite (`tests/engine_suite.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

# One query's answer: rows (int64) and their scores (float32), best first.
Ranked = tuple[np.ndarray, np.ndarray]

TERMS, VECTORS = "terms", "vectors"


class Engine(ABC):
    """Rows in a local directory: put, commit, search."""

    name: ClassVar[str]
    takes: ClassVar[str]  # TERMS or VECTORS
    exact: ClassVar[bool]  # search returns the true top-k of its scoring (no approximation)

    def __init__(self, root: Path, params: dict[str, Any]):
        self.root = Path(root)
        self.params = dict(params)

    @classmethod
    @abstractmethod
    def create(cls, root: Path, **options: Any) -> Engine:
        """A new, empty engine in `root` (created; must not hold another engine)."""

    @classmethod
    @abstractmethod
    def open(cls, root: Path, params: dict[str, Any]) -> Engine:
        """The engine committed in `root`; `params` are what `commit` returned."""

    @property
    @abstractmethod
    def rows(self) -> int:
        """Rows held, committed or not (every row below this has an item)."""

    @abstractmethod
    def put(self, rows: Sequence[int], items: Any) -> None:
        """Give rows their items: terms lists or an (n, dim) float32 array. A row is
        new (rows are added in order, from `self.rows` on) or replaced."""

    @abstractmethod
    def commit(self) -> dict[str, Any]:
        """Make every put durable in `root` and searchable; return the params `open` needs."""

    @abstractmethod
    def search(self, queries: Any, k: int) -> list[Ranked]:
        """Best k rows per query (terms lists or a (q, dim) array), over committed rows.
        Lexical engines return only rows that match a query term."""

    def check_new_rows(self, rows: Sequence[int]) -> None:
        """Rows at or past the end must continue it in order, each once (no holes)."""
        given = np.asarray(rows, np.int64)
        new = given[given >= self.rows]
        if not np.array_equal(new, np.arange(self.rows, self.rows + len(new))):
            raise ValueError(f"new rows must continue the {self.rows} held, in order, once each")


def empty_ranked() -> Ranked:
    return np.zeros(0, np.int64), np.zeros(0, np.float32)
