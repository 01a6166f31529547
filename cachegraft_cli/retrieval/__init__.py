"""Retrieval index over a passage set: BM25, dense, or hybrid.

Modules: `index` (the index, build, load), `tokens` (tokenizer and stemmer), `lexical`
(the BM25 part), `dense` (the embedding part), `ranking` (top-k, fusion), `files` (IO).

- BM25 (Lucene variant, k1=1.5, b=0.75; the scores of bm25s' `lucene` method,
  computed at query time by `cachegraft_cli.bm25` so that passages can be
  appended without a rebuild) over title + text. Tokens:
  lowercase words of 2+ word characters minus bm25s' English stopwords, stemmed
  with PyStemmer when it is installed (recorded in the index; a stemmed index
  refuses to load without it). Documents with score 0 are never returned.
- Dense: a sentence-transformers model (hub id or local directory), normalised
  embeddings, cosine = dot product over a float32 numpy matrix.
- Hybrid: reciprocal-rank fusion, score = sum over the two rankings of
  1 / (60 + rank), each ranking cut at max(k, 100).

Saved as a directory (local path or fsspec URL): `index.json` (written last;
its presence marks a complete index; it lists the BM25 blocks), `bm25_vocab.json`,
`bm25/<block>/*.npy` (immutable postings blocks, memory-mapped on load; an
update writes only new blocks), `passages.bin` (ids and content hashes by row,
`cachegraft_cli.packed` format), `dense.npy`. Heavy modules are imported inside functions.
"""

from cachegraft_cli.retrieval.dense import load_embedder
from cachegraft_cli.retrieval.index import (
    DEFAULT_EMBEDDER,
    KINDS,
    Doc,
    DocLike,
    Hit,
    RetrievalIndex,
    build_index,
    doc_hash,
    load_index,
    passage_fingerprint,
)

__all__ = ["DEFAULT_EMBEDDER", "KINDS", "Doc", "DocLike", "Hit", "RetrievalIndex", "build_index", "doc_hash",
           "load_embedder", "load_index", "passage_fingerprint"]
