"""The appendable BM25 scores exactly what bm25s' Lucene variant precomputes."""

from __future__ import annotations

import numpy as np
import pytest

from cachegraft_cli import bm25 as b


def corpus(rng, n, vocab=40):
    return [rng.integers(0, vocab, int(rng.integers(0, 30))).tolist() for _ in range(n)]


def reference_scores(docs, query, vocab=40):
    bm25s = pytest.importorskip("bm25s")
    index = bm25s.BM25(k1=b.K1, b=b.B, method="lucene")
    index.index((docs, {f"t{i}": i for i in range(vocab)}), create_empty_token=False, show_progress=False)
    return np.asarray(index.get_scores_from_ids(query), dtype=np.float32)


def test_one_block_equals_bm25s():
    rng = np.random.default_rng(0)
    docs = corpus(rng, 200)
    index = b.Bm25()
    for row, d in enumerate(docs):
        index.add(row, d)
    for query in ([1, 2, 3], [7], [5, 5, 9], [39, 0]):
        assert np.allclose(index.scores(query, 40), reference_scores(docs, query), rtol=1e-5, atol=1e-6)


def test_appended_blocks_and_replacements_equal_a_fresh_build(monkeypatch):
    monkeypatch.setattr(b, "MAX_BLOCKS", 3)
    rng = np.random.default_rng(1)
    docs, index = [], b.Bm25()
    for size in (50, 1, 30, 7, 12):  # the fifth block exceeds MAX_BLOCKS: merged into one
        new = corpus(rng, size)
        for d in new:
            index.add(len(docs), d)
            docs.append(d)
        index.flush(40)
        assert np.allclose(index.scores([3, 4, 11], 40), reference_scores(docs, [3, 4, 11]), rtol=1e-5, atol=1e-6)
    assert len(index.blocks) <= 3
    docs[10] = [3, 3, 3]
    index.add(10, [3, 3, 3])
    assert np.allclose(index.scores([3], 40), reference_scores(docs, [3]), rtol=1e-5, atol=1e-6)
    assert int(np.argmax(index.scores([3], 40))) == 10


def test_terms_unknown_to_old_blocks_and_empty_queries():
    index = b.Bm25()
    index.add(0, [0, 1])
    index.flush(2)
    index.add(1, [5, 5])  # term 5 appears after the first block was made
    got = index.scores([5], 6)
    assert got[0] == 0 and got[1] > 0
    assert not index.scores([], 6).any() and b.Bm25().scores([1], 2).shape == (0,)
