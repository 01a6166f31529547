"""Synthetic passages and queries for the retrieval scale benchmark (not a benchmark itself).

Text: words drawn from a Zipf law (exponent 1.07, as English text roughly
follows) over a vocabulary whose head is SQuAD dev's own words by frequency
and whose tail is made-up words, so the vocabulary grows with the corpus the
way real vocabularies do (Heaps' law). Passages have 40-160 words, like
SQuAD paragraphs after chunking. A query takes 4-8 words of one passage (its
"gold") plus 1-3 frequent words, so every query has matches and a likely answer.

Vectors: the real embedder embeds a sample (`benchmarks/retrieval_scale.py`);
the rest are drawn from a Gaussian with the sample's mean and covariance,
normalised: random, but with the sample's anisotropy (isotropic random vectors
in 384 dimensions are all nearly orthogonal, which no real embedding is).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ZIPF = 1.07
MIN_WORDS, MAX_WORDS = 40, 160
TAIL_WORDS = 2_000_000  # made-up words after SQuAD's own


@dataclass(frozen=True)
class SynthDoc:
    id: str
    text: str
    title: str = ""


def squad_words(path: str) -> list[str]:
    """SQuAD dev's words, most frequent first."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    counts: Counter[str] = Counter()
    for article in data:
        for para in article["paragraphs"]:
            counts.update(re.findall(r"[a-z]{2,}", para["context"].lower()))
    return [w for w, _ in counts.most_common()]


class Vocabulary:
    """Rank -> word, and a Zipf sampler over ranks."""

    def __init__(self, head: list[str], size: int = 0):
        self.head = head
        self.size = size or len(head) + TAIL_WORDS
        ranks = np.arange(1, self.size + 1, dtype=np.float64)
        weights = ranks ** -ZIPF
        self.cdf = np.cumsum(weights / weights.sum())

    def word(self, rank: int) -> str:
        return self.head[rank] if rank < len(self.head) else f"zq{np.base_repr(rank, 36).lower()}"

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.minimum(np.searchsorted(self.cdf, rng.random(n)), self.size - 1)


def passages(vocab: Vocabulary, n: int, seed: int, start: int = 0) -> list[SynthDoc]:
    """n passages with ids syn-<start>...; the same (seed, start) gives the same text."""
    rng = np.random.default_rng([seed, start])
    lengths = rng.integers(MIN_WORDS, MAX_WORDS + 1, size=n)
    ranks = vocab.sample(rng, int(lengths.sum()))
    words = _words(vocab, ranks)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [SynthDoc(f"syn-{start + i}", " ".join(words[bounds[i]:bounds[i + 1]])) for i in range(n)]


def queries(docs: list[SynthDoc], vocab: Vocabulary, n: int, seed: int) -> list[tuple[str, str]]:
    """(query, gold id): words of one passage plus a few frequent words."""
    rng = np.random.default_rng([seed, 7])
    out = []
    for i in rng.choice(len(docs), size=min(n, len(docs)), replace=False):
        words = docs[i].text.split()
        picked = rng.choice(words, size=min(len(words), int(rng.integers(4, 9))), replace=False).tolist()
        picked += [vocab.word(int(r)) for r in rng.integers(0, 200, size=int(rng.integers(1, 4)))]
        out.append((" ".join(picked), docs[i].id))
    return out


def gaussian_like(sample: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n normalised float32 vectors from the sample's mean and covariance."""
    rng = np.random.default_rng([seed, 11])
    mean = sample.mean(axis=0)
    chol = np.linalg.cholesky(np.cov(sample, rowvar=False) + 1e-6 * np.eye(sample.shape[1]))
    out = np.empty((n, sample.shape[1]), dtype=np.float32)
    for lo in range(0, n, 65536):  # bounded temporaries
        z = rng.standard_normal((min(65536, n - lo), sample.shape[1]))
        block = mean + z @ chol.T
        out[lo:lo + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def _words(vocab: Vocabulary, ranks: np.ndarray) -> list[str]:
    unique, inverse = np.unique(ranks, return_inverse=True)
    names = np.array([vocab.word(int(r)) for r in unique], dtype=object)
    return names[inverse].tolist()
