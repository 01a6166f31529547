"""Lexical engine on tantivy (Rust, Lucene-like): BM25 over terms the index layer made.

The index layer tokenises (its own words, stopwords and stemming), so tantivy
only splits on whitespace: every engine sees the same terms. Scoring is
tantivy's BM25 with its fixed k1 = 1.2, b = 0.75 and one-byte length norms
(lengths above 40 terms are rounded, as Lucene does); the hand-written BM25
this replaced used k1 = 1.5 and exact lengths (docs/results.md measures the
difference). Each commit adds segments that tantivy merges in the background
of the writer (log merge policy); files are memory-mapped, so opening is
instant and resident memory follows what queries touch. A replaced row is a
delete plus an add.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cachegraft_cli.retrieval.engines.base import TERMS, Engine, Ranked, empty_ranked

TOKENIZER = "cg_whitespace"
TEXT, ROW = "terms", "row"
TIE_MARGIN = 16
WRITER_HEAP = 128_000_000  # bytes over all writer threads; segments flush when it fills


def _schema():
    import tantivy

    builder = tantivy.SchemaBuilder()
    builder.add_text_field(TEXT, tokenizer_name=TOKENIZER, index_option="freq")
    builder.add_integer_field(ROW, fast=True, indexed=True)
    return builder.build()


def writable(root: Path) -> bool:
    """Whether files can be made in `root` (False on a read-only mount, whoever asks, root included)."""
    try:
        if os.statvfs(root).f_flag & os.ST_RDONLY:
            return False
    except OSError:
        return False
    return os.access(root, os.W_OK)


def read_only_view(root: Path):
    """A private writable directory whose entries are symlinks to the files of `root`."""
    from cachegraft_cli.retrieval.engines.files import WorkDir

    view = WorkDir()
    for entry in os.scandir(root):
        if entry.is_file() and not entry.name.endswith(".lock"):
            os.symlink(os.path.abspath(entry.path), view.path / entry.name)
    return view


def _analyzer():
    import tantivy

    return tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.whitespace()).build()


class TantivyEngine(Engine):
    name = "tantivy"
    takes = TERMS
    exact = True

    def __init__(self, root: Path, params: dict[str, Any], index):
        super().__init__(root, params)
        self._index = index
        self._index.register_tokenizer(TOKENIZER, _analyzer())
        self._schema = index.schema
        self._writer = None
        self.view = None  # a read-only view of the files (`read_only_view`), when the engine reads one
        self._rows = int(params.get("rows", 0))
        self._searcher = index.searcher()

    @classmethod
    def create(cls, root: Path, **options: Any) -> TantivyEngine:
        import tantivy

        Path(root).mkdir(parents=True, exist_ok=True)
        return cls(root, {"rows": 0, "k1": 1.2, "b": 0.75}, tantivy.Index(_schema(), str(root), reuse=False))

    @classmethod
    def open(cls, root: Path, params: dict[str, Any]) -> TantivyEngine:
        import tantivy

        if writable(root):
            return cls(root, params, tantivy.Index.open(str(root)))
        # tantivy takes a lockfile in the index directory even to read; on read-only media it reads
        # through a private directory of symlinks instead (the index files stay where they are)
        view = read_only_view(root)
        engine = cls(root, params, tantivy.Index.open(str(view.path)))
        engine.view = view  # the symlinks live as long as the engine
        return engine

    @property
    def rows(self) -> int:
        return self._rows

    def put(self, rows: Sequence[int], items: Sequence[Sequence[str]]) -> None:
        import tantivy

        self.check_new_rows(rows)
        writer = self._writer_now()
        for row, terms in zip(rows, items):
            if row < self._rows:
                writer.delete_documents_by_term(ROW, int(row))
            else:
                self._rows += 1
            doc = tantivy.Document()
            doc.add_text(TEXT, " ".join(terms))
            doc.add_integer(ROW, int(row))
            writer.add_document(doc)

    def commit(self) -> dict[str, Any]:
        if self._writer is not None:
            self._writer.commit()
            self._writer.wait_merging_threads()  # finishes merges, collects unused files; ends the writer
            self._writer = None
            self._index.reload()
            self._searcher = self._index.searcher()
        self.params["rows"] = self._rows
        return dict(self.params)

    def search(self, queries: Sequence[Sequence[str]], k: int) -> list[Ranked]:
        return [self._one(terms, k) for terms in queries]

    def _one(self, terms: Sequence[str], k: int) -> Ranked:
        import tantivy

        if not terms or k < 1:
            return empty_ranked()
        clauses = [(tantivy.Occur.Should, tantivy.Query.term_query(self._schema, TEXT, t)) for t in terms]
        # a few more than k, so that ties are broken by row, not by how rows fell into segments
        hits = self._searcher.search(tantivy.Query.boolean_query(clauses), k + TIE_MARGIN, count=False).hits
        if not hits:
            return empty_ranked()
        rows = np.asarray(self._searcher.fast_field_values(ROW, [address for _, address in hits]), np.int64)
        scores = np.asarray([score for score, _ in hits], np.float32)
        order = np.lexsort((rows, -scores))[:k]
        return rows[order], scores[order]

    def _writer_now(self):
        if self.view is not None:
            from cachegraft_cli.errors import RetrievalIndexError

            raise RetrievalIndexError(f"{self.root} is on read-only media; this index cannot change there.",
                                      "Copy the store to writable storage to update its index.")
        if self._writer is None:
            threads = max(1, min(2, os.cpu_count() or 1))
            self._writer = self._index.writer(WRITER_HEAP, threads)
        return self._writer
