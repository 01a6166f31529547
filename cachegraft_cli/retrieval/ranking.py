"""Top-k selection and reciprocal-rank fusion (hybrid: score = sum over the two rankings of
1 / (RRF_K + rank), each ranking cut at max(k, RRF_DEPTH))."""

from __future__ import annotations

import numpy as np

RRF_K = 60
RRF_DEPTH = 100


def top(scores: np.ndarray, k: int, positive: bool = False) -> np.ndarray:
    """Row indices of the k best scores, best first (ties: lower row first)."""
    if positive:
        candidates = np.flatnonzero(scores > 0)
    else:
        candidates = np.arange(len(scores))
    if len(candidates) > k:
        part = np.argpartition(-scores[candidates], k - 1)[:k]
        candidates = candidates[part]
    return candidates[np.lexsort((candidates, -scores[candidates]))]


def rrf(rankings: list[np.ndarray], n: int) -> np.ndarray:
    fused = np.zeros(n, dtype=np.float64)
    for ranking in rankings:
        fused[ranking] += 1.0 / (RRF_K + 1 + np.arange(len(ranking)))
    return fused
