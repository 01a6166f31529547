"""BM25 (Lucene variant) over token ids, appendable without a rebuild.

Scores are computed at query time from term-major postings, with the corpus
statistics of the moment:

    score(q, d) = sum over query tokens t of idf(t) * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
    idf(t) = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

which is what bm25s' `lucene` method precomputes into its score matrix. A
precomputed matrix bakes N, df and avgdl into every entry, so adding one
passage would rewrite all of them; postings do not. Passages are kept in
immutable **blocks** (postings + the forward token lists); adding passages
makes a new block and updates two small arrays (df per term, length per
passage). Many blocks are merged into one now and then (`MAX_BLOCKS`), so the
cost of appending stays proportional to what is appended, amortised.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

K1, B = 1.5, 0.75
MAX_BLOCKS = 16
BLOCK_ARRAYS = ("tokens", "offsets", "indptr", "rows", "tf")


@dataclass
class Block:
    """Passages [base, base + len(offsets) - 1): forward token lists and term-major postings."""

    tokens: np.ndarray  # int32, all token ids of the block's passages
    offsets: np.ndarray  # int64, passage i is tokens[offsets[i]:offsets[i + 1]]
    indptr: np.ndarray  # int64 (terms + 1,): postings of term t are [indptr[t], indptr[t + 1])
    rows: np.ndarray  # int32 passage rows (global), ascending within a term
    tf: np.ndarray  # float32 term frequency
    name: str = ""  # its directory once saved (blocks are immutable: saved once, never rewritten)

    @property
    def passages(self) -> int:
        return len(self.offsets) - 1

    def postings(self, term: int) -> tuple[np.ndarray, np.ndarray]:
        if term + 1 >= len(self.indptr):
            return self.rows[:0], self.tf[:0]
        lo, hi = int(self.indptr[term]), int(self.indptr[term + 1])
        return self.rows[lo:hi], self.tf[lo:hi]

    def docs(self) -> list[list[int]]:
        return [self.tokens[self.offsets[i]:self.offsets[i + 1]].tolist() for i in range(self.passages)]

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in BLOCK_ARRAYS}


def build_block(docs: list[list[int]], base: int, terms: int) -> Block:
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    tokens = np.fromiter(chain.from_iterable(docs), dtype=np.int32, count=int(lengths.sum()))
    rows = np.repeat(np.arange(base, base + len(docs), dtype=np.int64), lengths)
    span = base + len(docs) + 1
    pairs, counts = np.unique(tokens.astype(np.int64) * span + rows, return_counts=True)  # sorted by (term, row)
    term_of = pairs // span
    indptr = np.searchsorted(term_of, np.arange(terms + 1), side="left").astype(np.int64)
    return Block(tokens, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), indptr,
                 (pairs % span).astype(np.int32), counts.astype(np.float32))


class Bm25:
    """The index proper: blocks, df per term, length per passage, and passages not yet in a block."""

    def __init__(self, blocks: list[Block] | None = None, terms: int = 0):
        self.blocks: list[Block] = blocks or []
        self.lengths = (
            np.concatenate([np.diff(b.offsets) for b in self.blocks]) if self.blocks else np.zeros(0, np.int64)
        )
        self.df = np.zeros(terms, dtype=np.int64)
        for block in self.blocks:
            self._count_terms(block)
        self._pending: list[list[int]] = []
        self._replaced: dict[int, list[int]] = {}
        self._norm: np.ndarray | None = None  # k1 * (1 - b + b * len / avgdl), per passage

    def count(self) -> int:
        return len(self.lengths) + len(self._pending)

    def add(self, row: int, ids: list[int]) -> None:
        """Passage `row` gets token ids `ids`: a new row (== count()) or a replacement."""
        if row == self.count():
            self._pending.append(ids)
        else:
            self._replaced[row] = ids

    def scores(self, ids: list[int], terms: int) -> np.ndarray:
        """Scores of every passage for query token ids (a repeated token counts again)."""
        self.flush(terms)
        out = np.zeros(self.count(), dtype=np.float32)
        if not ids or not len(self.lengths):
            return out
        if self._norm is None:
            self._norm = (K1 * (1 - B + B * self.lengths / max(float(self.lengths.mean()), 1e-9))).astype(np.float32)
        norm, n = self._norm, len(self.lengths)
        for term in ids:
            df = self.df[term] if term < len(self.df) else 0
            idf = np.log(1 + (n - df + 0.5) / (df + 0.5))
            for block in self.blocks:
                rows, tf = block.postings(term)
                out[rows] += np.float32(idf) * tf / (tf + norm[rows])
        return out

    def flush(self, terms: int) -> None:
        """Fold pending passages into a new block (or, after replacements, rebuild)."""
        if len(self.df) < terms:
            self.df = np.concatenate([self.df, np.zeros(terms - len(self.df), np.int64)])
        if self._replaced:
            self._rebuild(terms)
        elif self._pending:
            block = build_block(self._pending, len(self.lengths), terms)
            self._append(block)
            self._pending = []
            if len(self.blocks) > MAX_BLOCKS:
                self._rebuild(terms)

    def _append(self, block: Block) -> None:
        self.blocks.append(block)
        self.lengths = np.concatenate([self.lengths, np.diff(block.offsets)])
        self._norm = None
        self._count_terms(block)

    def _rebuild(self, terms: int) -> None:
        docs = [d for b in self.blocks for d in b.docs()] + self._pending
        for row, ids in self._replaced.items():
            docs[row] = ids
        self.blocks, self._pending, self._replaced = [], [], {}
        self.lengths, self.df = np.zeros(0, np.int64), np.zeros(terms, np.int64)
        self._append(build_block(docs, 0, terms))

    def _count_terms(self, block: Block) -> None:
        counts = np.diff(block.indptr)
        if len(counts) > len(self.df):
            self.df = np.concatenate([self.df, np.zeros(len(counts) - len(self.df), np.int64)])
        self.df[: len(counts)] += counts
