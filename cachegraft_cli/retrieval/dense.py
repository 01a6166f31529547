"""The dense part of an index: normalised sentence-transformers embeddings, cosine = dot product."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from cachegraft_cli.errors import ModelLoadError, RetrievalIndexError


class DensePart:
    """Normalised embeddings (rows = passages) + the model, loaded on first use."""

    def __init__(self, embedder: str, matrix: np.ndarray | None = None, progress: bool = True):
        self.embedder = embedder
        self.matrix: np.ndarray = matrix if matrix is not None else np.zeros((0, 0), dtype=np.float32)  # 0 x 0: empty
        self.progress = progress
        self._model: Any = None  # a SentenceTransformer, loaded on first use

    def model(self):
        if self._model is None:
            self._model = load_embedder(self.embedder)
        return self._model

    def set_rows(self, rows: list[int], texts: list[str]) -> None:
        vectors = self._encode(texts, query=False)
        n = max([*rows, -1]) + 1
        if self.matrix.shape[1] == 0:  # the first rows set the width
            self.matrix = np.zeros((0, vectors.shape[1]), dtype=np.float32)
        self._check_dim(vectors)
        if n > len(self.matrix):
            pad = np.zeros((n - len(self.matrix), self.matrix.shape[1]), dtype=np.float32)
            self.matrix = np.concatenate([self.matrix, pad])
        self.matrix[rows] = vectors

    def scores_many(self, queries: list[str]) -> np.ndarray:
        vectors = self._encode(queries, query=True)
        self._check_dim(vectors)
        return vectors @ self.matrix.T

    def _check_dim(self, vectors: np.ndarray) -> None:
        if vectors.shape[1] != self.matrix.shape[1]:
            raise RetrievalIndexError(
                f"embedding model {self.embedder!r} gives {vectors.shape[1]}-dim vectors, "
                f"the index holds {self.matrix.shape[1]}-dim ones",
                "Use the model the index was built with, or rebuild the index.",
            )

    def _encode(self, texts: list[str], query: bool) -> np.ndarray:
        model = self.model()
        encode = model.encode_query if query else model.encode_document
        show = self.progress and not query and len(texts) > 64
        vectors = encode(texts, batch_size=32, normalize_embeddings=True,
                         convert_to_numpy=True, show_progress_bar=show)
        return np.asarray(vectors, dtype=np.float32)


@functools.lru_cache(maxsize=2)
def load_embedder(name: str):
    """A SentenceTransformer from a hub id or a local directory (the last two are kept)."""
    from cachegraft_cli.progress import loading

    try:
        from sentence_transformers import SentenceTransformer

        with loading(f"loading embedder {name}"):
            return SentenceTransformer(name)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load the embedding model {name!r}: {str(err).splitlines()[0]}",
            "Pass a local sentence-transformers directory or a hub id (the hub must be reachable).",
        ) from None
