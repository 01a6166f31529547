"""The tests every retrieval engine passes (the `Engine` contract), like zarr's StoreTests.

A backend's test module subclasses `LexicalEngineTests` or `VectorEngineTests`
and sets `engine_name`; pytest collects the inherited tests for it.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachegraft_cli.retrieval import engines

WORDS = [f"w{i}" for i in range(60)]
DIM = 16


class EngineTests:
    engine_name = ""

    # ---------------------------------------------------------------- data hooks

    def items(self, rng: np.random.Generator, n: int):
        raise NotImplementedError

    def query_for(self, items, i: int):
        """A query whose best row is the item's own row."""
        raise NotImplementedError

    def queries(self, items, rows: list[int]):
        return [self.query_for(items, r) for r in rows]

    # ---------------------------------------------------------------- helpers

    def make(self, tmp_path, name: str = "e"):
        return engines.create(self.engine_name, tmp_path / name)

    def filled(self, tmp_path, n: int = 40, seed: int = 0):
        engine = self.make(tmp_path)
        items = self.items(np.random.default_rng(seed), n)
        engine.put(list(range(n)), items)
        engine.commit()
        return engine, items

    def reopen(self, engine):
        params = engine.commit()
        return engines.open_engine(self.engine_name, engine.root, params)

    def best(self, engine, query):
        rows, _ = engine.search(self.batch([query]), 1)[0]
        return int(rows[0]) if len(rows) else None

    def batch(self, queries):
        return queries

    # ---------------------------------------------------------------- the contract

    def test_registered_with_its_kind(self):
        cls = engines.engine_class(self.engine_name)
        assert cls.name == self.engine_name and engines.takes(self.engine_name) == cls.takes

    def test_empty_engine_finds_nothing(self, tmp_path):
        engine = self.make(tmp_path)
        assert engine.rows == 0
        engine.commit()
        items = self.items(np.random.default_rng(1), 2)
        (rows, scores), = engine.search(self.batch([self.query_for(items, 0)]), 5)
        assert len(rows) == len(scores) == 0

    def test_each_row_is_found_by_its_own_query(self, tmp_path):
        engine, items = self.filled(tmp_path)
        assert engine.rows == 40
        found = engine.search(self.batch(self.queries(items, list(range(40)))), 1)
        assert [int(rows[0]) for rows, _ in found] == list(range(40))

    def test_results_are_sorted_and_cut_at_k(self, tmp_path):
        engine, items = self.filled(tmp_path)
        for k in (1, 3, 7):
            for rows, scores in engine.search(self.batch(self.queries(items, [0, 5, 9])), k):
                assert len(rows) <= k and len(set(rows.tolist())) == len(rows)
                assert np.all(np.diff(scores) <= 1e-6) and rows.dtype == np.int64
        rows, _ = engine.search(self.batch([self.query_for(items, 2)]), 500)[0]
        assert 1 <= len(rows) <= 40

    def test_reopened_engine_answers_the_same(self, tmp_path):
        engine, items = self.filled(tmp_path)
        queries = self.batch(self.queries(items, [1, 2, 3, 30]))
        before = engine.search(queries, 5)
        again = self.reopen(engine)
        assert again.rows == 40
        for (r1, s1), (r2, s2) in zip(before, again.search(queries, 5)):
            assert r1.tolist() == r2.tolist() and np.allclose(s1, s2, atol=1e-5)

    def test_appends_after_reopen_equal_a_fresh_build(self, tmp_path):
        rng = np.random.default_rng(3)
        items = self.items(rng, 60)
        engine = self.make(tmp_path, "grown")
        for lo, hi in ((0, 20), (20, 35), (35, 60)):
            engine.put(list(range(lo, hi)), self.take(items, lo, hi))
            engine.commit()
            engine = self.reopen(engine)
        fresh = self.make(tmp_path, "fresh")
        fresh.put(list(range(60)), items)
        fresh.commit()
        assert engine.rows == fresh.rows == 60
        queries = self.batch(self.queries(items, list(range(0, 60, 4))))
        for (r1, s1), (r2, s2) in zip(engine.search(queries, 3), fresh.search(queries, 3)):
            assert int(r1[0]) == int(r2[0]) and s1[0] == pytest.approx(s2[0], rel=1e-4, abs=1e-5)

    def test_a_replaced_row_answers_with_its_new_item(self, tmp_path):
        engine, items = self.filled(tmp_path)
        other = self.items(np.random.default_rng(99), 41)
        engine.put([7], self.take(other, 40, 41))
        engine.commit()
        for e in (engine, self.reopen(engine)):
            assert e.rows == 40
            assert self.best(e, self.query_for(other, 40)) == 7
            old = e.search(self.batch([self.query_for(items, 7)]), 40)[0][0].tolist()
            assert old[:1] != [7] and old.count(7) <= 1

    def test_uncommitted_rows_are_not_searched(self, tmp_path):
        engine, _ = self.filled(tmp_path, n=10)
        more = self.items(np.random.default_rng(5), 11)
        engine.put([10], self.take(more, 10, 11))
        assert engine.rows == 11
        hits = engine.search(self.batch([self.query_for(more, 10)]), 20)[0][0].tolist()
        assert 10 not in hits
        engine.commit()
        assert self.best(engine, self.query_for(more, 10)) == 10

    def test_rows_must_continue_in_order(self, tmp_path):
        engine = self.make(tmp_path)
        items = self.items(np.random.default_rng(2), 3)
        with pytest.raises(ValueError, match="continue"):
            engine.put([1], self.take(items, 0, 1))
        with pytest.raises(ValueError, match="continue"):
            engine.put([0, 0], self.take(items, 0, 2))

    def test_many_small_commits_stay_correct(self, tmp_path):
        rng = np.random.default_rng(4)
        items = self.items(rng, 30)
        engine = self.make(tmp_path)
        for row in range(30):
            engine.put([row], self.take(items, row, row + 1))
            engine.commit()
        engine = self.reopen(engine)
        found = engine.search(self.batch(self.queries(items, list(range(30)))), 1)
        assert [int(rows[0]) for rows, _ in found] == list(range(30))

    def take(self, items, lo: int, hi: int):
        return items[lo:hi]


class LexicalEngineTests(EngineTests):
    def items(self, rng, n):
        # each row: a unique marker word plus common words, so the marker finds it
        return [[f"mark{int(rng.integers(1 << 30))}x{i}"] + rng.choice(WORDS, size=int(rng.integers(3, 12))).tolist()
                for i in range(n)]

    def query_for(self, items, i):
        return [items[i][0]]

    def test_no_matching_term_finds_nothing(self, tmp_path):
        engine, _ = self.filled(tmp_path)
        assert [len(r) for r, _ in engine.search([["absent"], []], 5)] == [0, 0]

    def test_bm25_orders_by_term_frequency_and_rarity(self, tmp_path):
        engine = self.make(tmp_path)
        docs = [["apple", "pear"], ["apple", "apple", "pear"], ["pear", "plum"], ["kiwi"]] + [["pear"]] * 6
        engine.put(list(range(len(docs))), docs)
        engine.commit()
        rows, scores = engine.search([["apple"]], 5)[0]
        assert rows.tolist() == [1, 0] and scores[0] > scores[1] > 0  # more occurrences, same length class
        rows, _ = engine.search([["plum", "pear"]], 1)[0]
        assert rows.tolist() == [2]  # the rare term decides


class VectorEngineTests(EngineTests):
    def items(self, rng, n):
        x = rng.standard_normal((n, DIM)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def query_for(self, items, i):
        return items[i]

    def batch(self, queries):
        return np.stack(queries).astype(np.float32)

    def test_scores_are_cosine_similarities(self, tmp_path):
        engine, items = self.filled(tmp_path)
        rows, scores = engine.search(items[3:4], 5)[0]
        assert int(rows[0]) == 3 and scores[0] == pytest.approx(1.0, abs=2e-2)
        assert np.allclose(scores, items[rows] @ items[3], atol=2e-2)

    def test_other_dimensions_are_refused(self, tmp_path):
        engine, _ = self.filled(tmp_path)
        with pytest.raises(ValueError, match="dim"):
            engine.put([40], np.ones((1, DIM + 1), np.float32))
        with pytest.raises(ValueError, match="dim"):
            engine.search(np.ones((1, DIM - 1), np.float32), 3)
