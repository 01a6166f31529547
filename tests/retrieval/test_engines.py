"""Every retrieval engine against the shared suite (tests/engine_suite.py), plus what is engine-specific."""

from __future__ import annotations

import json

import numpy as np
from engine_suite import DIM, LexicalEngineTests, VectorEngineTests

from cachegraft_cli.retrieval import engines
from cachegraft_cli.retrieval.engines import segments
from cachegraft_cli.retrieval.engines.flat import exact_search


class TestTantivy(LexicalEngineTests):
    engine_name = "tantivy"


class TestUsearch(VectorEngineTests):
    engine_name = "usearch"


class TestFlat(VectorEngineTests):
    engine_name = "flat"

    def test_exact_scores_are_dot_products(self, tmp_path):
        engine, items = self.filled(tmp_path)
        rows, scores = engine.search(items[5:6], 40)[0]
        expected = items @ items[5]
        assert np.allclose(scores, expected[rows], atol=1e-6)
        assert rows.tolist() == np.lexsort((np.arange(40), -expected)).tolist()


def test_defaults_are_registered_for_their_part():
    assert engines.takes(engines.DEFAULTS["terms"]) == "terms"
    assert engines.takes(engines.DEFAULTS["vectors"]) == "vectors"


def test_segments_merge_by_tier_and_drop_dead_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "MERGE_FACTOR", 3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    engine = engines.create("flat", tmp_path / "e")
    for row in range(9):  # tier 0 (1-2 rows) fills at 3 segments, then tier 1 (3-8) at 3
        engine.put([row], x[row:row + 1])
        engine.commit()
    assert [len(s.rows) for s in engine.segments] == [9]
    engine.put([2, 9], np.stack([x[10], x[9]]))  # replace row 2, add row 9
    engine.commit()
    assert [s.dead for s in engine.segments] == [1, 0]
    rows, scores = engine.search(x[10:11], 3)[0]
    assert rows.tolist()[0] == 2 and scores[0] > 0.999 and rows.tolist().count(2) == 1
    manifest = json.loads((tmp_path / "e" / "segments.json").read_text())
    on_disk = sorted(p.name for p in (tmp_path / "e").iterdir() if p.is_dir())
    assert on_disk == sorted(s["name"] for s in manifest["segments"])  # merged-away segments removed


def test_an_append_writes_a_new_segment_and_leaves_old_files(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((20, DIM)).astype(np.float32)
    engine = engines.create("usearch", tmp_path / "e")
    engine.put(list(range(10)), x[:10])
    engine.commit()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "e").rglob("*") if p.is_file() and p.name != "segments.json"}
    engine.put(list(range(10, 20)), x[10:])
    engine.commit()
    after = {p: p.stat().st_mtime_ns for p in (tmp_path / "e").rglob("*") if p.is_file()}
    assert all(after[p] == t for p, t in before.items()) and len(engine.segments) == 2


def test_usearch_scores_small_segments_exactly_and_large_ones_through_its_graph(tmp_path, monkeypatch):
    """Segments of at most EXACT_ROWS rows are brute-forced (every self-query finds its own row);
    larger ones go through the HNSW graph, whose recall of self-queries is held to 99%.

    The graph is built on one thread here: usearch's concurrent inserts make the graph depend on
    thread timing, and over 30 two-thread builds of these 600 rows self-query hits ranged from
    574 to 600 (one-thread builds: 600 every time, the same graph each build)."""
    from cachegraft_cli.retrieval.engines import usearch

    monkeypatch.setattr(usearch, "thread_count", lambda: 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((600, DIM)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    for exact_rows, name in ((len(x), "exact"), (len(x) - 1, "graph")):
        brute = []
        monkeypatch.setattr(usearch, "EXACT_ROWS", exact_rows)
        monkeypatch.setattr(usearch, "exact_search", lambda *a, calls=brute: calls.append(1) or exact_search(*a))
        engine = engines.create("usearch", tmp_path / name)
        engine.put(list(range(len(x))), x)
        engine.commit()
        hits = sum(int(rows[0]) == i for i, (rows, _) in enumerate(engine.search(x, 3)))
        assert hits == len(x) if name == "exact" else hits >= 0.99 * len(x)
        assert bool(brute) == (name == "exact")
