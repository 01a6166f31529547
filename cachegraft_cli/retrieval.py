"""Retrieval index over a passage set: BM25, dense, or hybrid.

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

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cachegraft_cli.errors import (
    IndexMismatchError,
    IndexMissingError,
    ModelLoadError,
    NoPassagesError,
    RetrievalIndexError,
)

KINDS = ("bm25", "dense", "hybrid")
DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
RRF_K = 60
RRF_DEPTH = 100
FORMAT = "cachegraft-retrieval-index"
VERSION = 1
_TOKEN = re.compile(r"(?u)\b\w\w+\b")


class DocLike(Protocol):
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Doc:
    id: str
    text: str
    title: str = ""
    content_hash: str | None = None


@dataclass(frozen=True)
class Hit:
    id: str
    score: float


def doc_hash(doc: DocLike) -> str:
    """The doc's `content_hash` if it has one, else sha256 over title + text."""
    given = getattr(doc, "content_hash", None)
    return given or hashlib.sha256(f"{doc.title}\n{doc.text}".encode()).hexdigest()


def passage_fingerprint(pairs: Iterable[tuple[str, str]]) -> str:
    """sha256 over the sorted (id, content_hash) pairs of a passage set."""
    text = "".join(f"{pid}\t{chash}\n" for pid, chash in sorted(pairs))  # one update: same digest, faster
    return hashlib.sha256(text.encode()).hexdigest()


def _doc_text(doc: DocLike) -> str:
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


def _store_of(path: str) -> str:
    """The store directory for hints: the parent of an `index` folder."""
    trimmed = re.sub(r"/v-[0-9A-Za-z-]+$", "", path.rstrip("/"))  # a version directory (indexdir)
    return trimmed.rsplit("/", 1)[0] if trimmed.endswith("/index") else trimmed


def _rebuild_hint(store: str) -> str:
    return f"Run `cachegraft index --store {store}` to rebuild it."


# ---------------------------------------------------------------- BM25


class _Tokenizer:
    def __init__(self, stem: bool | None):
        self._stemmer = _load_stemmer(required=bool(stem)) if stem is not False else None
        self.stemmer_name = "pystemmer-english" if self._stemmer else None
        from bm25s.stopwords import STOPWORDS_EN

        self._stopwords = frozenset(STOPWORDS_EN)

    def __call__(self, text: str) -> list[str]:
        words = [w for w in _TOKEN.findall(text.lower()) if w not in self._stopwords]
        return self._stemmer.stemWords(words) if self._stemmer else words


def _load_stemmer(required: bool):
    try:
        import Stemmer  # PyStemmer
    except ImportError:
        if required:
            raise RetrievalIndexError(
                "this BM25 index was built with stemming but PyStemmer is not installed",
                "Install it (pip install PyStemmer) or rebuild the index.",
            ) from None
        return None
    return Stemmer.Stemmer("english")


class _Bm25:
    """The tokenizer, its vocabulary and the appendable BM25 postings (`cachegraft_cli.bm25`)."""

    def __init__(self, stem: bool | None, vocab: dict[str, int] | None = None, index=None):
        from cachegraft_cli.bm25 import Bm25

        self.tokenize = _Tokenizer(stem)
        self.vocab: dict[str, int] = vocab or {}
        self.index = index or Bm25(terms=len(self.vocab))

    def count(self) -> int:
        return self.index.count()

    def set(self, row: int, text: str) -> None:
        self.index.add(row, [self.vocab.setdefault(t, len(self.vocab)) for t in self.tokenize(text)])

    def scores(self, query: str) -> np.ndarray:
        ids = [self.vocab[t] for t in self.tokenize(query) if t in self.vocab]
        return self.index.scores(ids, len(self.vocab))

    def save(self, fs, root: str) -> list[str]:
        """Blocks are immutable: only those not yet at `root` are written (the last
        array last). Returns the names of all blocks, for index.json."""
        import uuid

        from cachegraft_cli.bm25 import BLOCK_ARRAYS

        self.index.flush(len(self.vocab))
        _write(fs, f"{root}/bm25_vocab.json", json.dumps(self.vocab).encode())
        for block in self.index.blocks:
            block.name = block.name or f"block-{uuid.uuid4().hex[:12]}"
            if fs.exists(f"{root}/bm25/{block.name}/{BLOCK_ARRAYS[-1]}.npy"):
                continue
            fs.makedirs(f"{root}/bm25/{block.name}", exist_ok=True)
            for name, array in block.arrays().items():
                _write_npy(fs, f"{root}/bm25/{block.name}/{name}.npy", array)
        return [b.name for b in self.index.blocks]

    @classmethod
    def load(cls, fs, root: str, meta: dict) -> _Bm25:
        """Blocks are memory-mapped when local. An index saved before blocks (one
        `bm25.npz`) is turned into one block from its token lists."""
        try:
            return cls._load(fs, root, meta)
        except FileNotFoundError as exc:
            raise RetrievalIndexError(f"{root}: BM25 file missing ({exc.filename or exc})", _rebuild_hint(_store_of(root))) from None

    @classmethod
    def _load(cls, fs, root: str, meta: dict) -> _Bm25:
        from cachegraft_cli.bm25 import BLOCK_ARRAYS, Block, Bm25, build_block

        vocab = json.loads(_read(fs, f"{root}/bm25_vocab.json"))
        names = meta.get("bm25_blocks")
        if names is None:
            arrays = np.load(_io(_read(fs, f"{root}/bm25.npz")), allow_pickle=False)
            tokens, offsets = arrays["tokens"], arrays["offsets"]
            docs = [tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
            blocks = [build_block(docs, 0, len(vocab))]
        else:
            blocks = [Block(**{a: _load_npy(fs, f"{root}/bm25/{n}/{a}.npy") for a in BLOCK_ARRAYS}, name=n) for n in names]
        return cls(meta["stemmer"] is not None, vocab, Bm25(blocks, terms=len(vocab)))


# ---------------------------------------------------------------- dense


class _Dense:
    """Normalised embeddings (rows = passages) + the model, loaded on first use."""

    def __init__(self, embedder: str, matrix: np.ndarray | None = None, progress: bool = True):
        self.embedder = embedder
        self.matrix = matrix
        self.progress = progress
        self._model = None

    def model(self):
        if self._model is None:
            self._model = load_embedder(self.embedder)
        return self._model

    def set_rows(self, rows: list[int], texts: list[str]) -> None:
        vectors = self._encode(texts, query=False)
        n = max([*rows, -1]) + 1
        if self.matrix is None:
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
    try:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(name)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"cannot load the embedding model {name!r}: {str(err).splitlines()[0]}",
            "Pass a local sentence-transformers directory or a hub id (the hub must be reachable).",
        ) from None


# ---------------------------------------------------------------- ranking


def _top(scores: np.ndarray, k: int, positive: bool = False) -> np.ndarray:
    """Row indices of the k best scores, best first (ties: lower row first)."""
    if positive:
        candidates = np.flatnonzero(scores > 0)
    else:
        candidates = np.arange(len(scores))
    if len(candidates) > k:
        part = np.argpartition(-scores[candidates], k - 1)[:k]
        candidates = candidates[part]
    return candidates[np.lexsort((candidates, -scores[candidates]))]


def _rrf(rankings: list[np.ndarray], n: int) -> np.ndarray:
    fused = np.zeros(n, dtype=np.float64)
    for ranking in rankings:
        fused[ranking] += 1.0 / (RRF_K + 1 + np.arange(len(ranking)))
    return fused


# ---------------------------------------------------------------- index


class RetrievalIndex:
    """Search a passage set. Build with `build_index`, reopen with `load_index`."""

    def __init__(self, kind: str, bm25: _Bm25 | None, dense: _Dense | None,
                 ids: list[str] | None = None, hashes: list[str] | None = None, source: dict | None = None):
        self.kind, self._bm25, self._dense = kind, bm25, dense
        self.ids: list[str] = ids or []
        self.hashes: list[str] = hashes or []
        # What the passages were read from (a store's segment names); lets a
        # store check the index in O(segments) instead of fingerprinting every passage.
        self.source = source
        self._rows: dict[str, int] | None = None
        self._fingerprint: str | None = None

    @property
    def _row(self) -> dict[str, int]:
        if self._rows is None:
            self._rows = {pid: i for i, pid in enumerate(self.ids)}
        return self._rows

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def embedder(self) -> str | None:
        return self._dense.embedder if self._dense else None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = passage_fingerprint(zip(self.ids, self.hashes))
        return self._fingerprint

    def view(self, kind: str) -> RetrievalIndex:
        """The same index searched as another kind it has the parts for
        (a hybrid index also serves `bm25` and `dense`); shares its data."""
        if kind not in KINDS or (kind != "dense" and not self._bm25) or (kind != "bm25" and not self._dense):
            raise RetrievalIndexError(f"a {self.kind} index cannot be searched as {kind!r}",
                                      f"Rebuild it with --kind {kind}.")
        view = copy.copy(self)
        view.kind = kind
        return view

    def check(self, fingerprint: str, n_passages: int | None = None, store: str = "DIR") -> None:
        """Refuse to serve a store whose passage set is not the one indexed."""
        if fingerprint == self.fingerprint:
            return
        theirs = f"{n_passages} passages" if n_passages is not None else "passages"
        raise IndexMismatchError(
            f"retrieval index built for {len(self)} passages (fingerprint {self.fingerprint[:12]}), "
            f"store has {theirs} (fingerprint {fingerprint[:12]})",
            _rebuild_hint(store),
        )

    def add(self, docs: Sequence[DocLike]) -> int:
        """Add new docs; a known id with new content is replaced, with the same
        content skipped. Only changed docs are tokenised / embedded. Returns
        how many rows were added or replaced."""
        changed = self._changes(docs)
        if changed:
            self._fingerprint = None
        for doc in changed:
            row = self._row.setdefault(doc.id, len(self.ids))
            if row == len(self.ids):
                self.ids.append(doc.id)
                self.hashes.append("")
            self.hashes[row] = doc_hash(doc)
            if self._bm25:
                self._bm25.set(row, _doc_text(doc))
        if self._dense and changed:
            self._dense.set_rows([self._row[d.id] for d in changed], [_doc_text(d) for d in changed])
        return len(changed)

    def _changes(self, docs: Sequence[DocLike]) -> list[DocLike]:
        batch: dict[str, DocLike] = {}
        for doc in docs:
            prev = batch.get(doc.id)
            if prev is not None and doc_hash(prev) != doc_hash(doc):
                raise RetrievalIndexError(f"passage id {doc.id!r} appears twice with different content")
            batch[doc.id] = doc
        return [d for d in batch.values()
                if d.id not in self._row or self.hashes[self._row[d.id]] != doc_hash(d)]

    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        if k < 1 or not self.ids:
            return [[] for _ in queries]
        queries = list(queries)
        if self.kind == "bm25":
            return [self._hits(s, _top(s, k, positive=True)) for s in self._bm25_scores(queries)]
        dense = self._dense.scores_many(queries) if queries else []
        if self.kind == "dense":
            return [self._hits(s, _top(s, k)) for s in dense]
        return [self._hybrid(b, d, k) for b, d in zip(self._bm25_scores(queries), dense)]

    def _bm25_scores(self, queries: list[str]) -> list[np.ndarray]:
        return [self._bm25.scores(q) for q in queries]

    def _hybrid(self, bm25: np.ndarray, dense: np.ndarray, k: int) -> list[Hit]:
        depth = max(k, RRF_DEPTH)
        fused = _rrf([_top(bm25, depth, positive=True), _top(dense, depth)], len(self.ids))
        return self._hits(fused, _top(fused, k, positive=True))

    def _hits(self, scores: np.ndarray, rows: np.ndarray) -> list[Hit]:
        return [Hit(self.ids[r], float(scores[r])) for r in rows]

    # ------------------------------------------------------------ persistence

    def save(self, path: str) -> None:
        """Write to a directory (local or fsspec URL); `index.json` goes last."""
        fs, root = _fs(path)
        fs.makedirs(root, exist_ok=True)
        if fs.exists(f"{root}/index.json"):
            fs.rm(f"{root}/index.json")
        blocks = self._bm25.save(fs, root) if self._bm25 else None
        if self._dense:
            _write_npy(fs, f"{root}/dense.npy", self._dense.matrix)
        from cachegraft_cli.packed import join_strings, pack_arrays

        _write(fs, f"{root}/passages.bin", pack_arrays({"ids": join_strings(self.ids, "id"),
                                                        "hashes": join_strings(self.hashes, "hash")}))
        _write(fs, f"{root}/index.json", json.dumps(self._manifest(blocks), indent=1).encode())
        _remove_unlisted_blocks(fs, root, blocks or [])

    def _manifest(self, blocks: list[str] | None) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "kind": self.kind,
            "passages": len(self.ids), "fingerprint": self.fingerprint,
            "stemmer": self._bm25.tokenize.stemmer_name if self._bm25 else None,
            "embedder": self.embedder,
            "dim": int(self._dense.matrix.shape[1]) if self._dense else None,
            "fusion": {"method": "rrf", "k": RRF_K, "depth": RRF_DEPTH} if self.kind == "hybrid" else None,
            "bm25_blocks": blocks,
            "source": self.source,  # ids and content hashes are in passages.bin
        }


def build_index(
    docs: Sequence[DocLike],
    kind: str = "bm25",
    embedder: str | None = None,
    *,
    stem: bool | None = None,
    progress: bool = True,
) -> RetrievalIndex:
    """Index docs (anything with id, title, text and optionally content_hash).
    `stem=None` stems when PyStemmer is installed; `embedder` defaults to
    DEFAULT_EMBEDDER for dense/hybrid."""
    if kind not in KINDS:
        raise RetrievalIndexError(f"unknown index kind {kind!r}", f"Use one of: {', '.join(KINDS)}.")
    if not docs:
        raise NoPassagesError("no passages to index", "Encode a corpus into the store first.")
    bm25 = _Bm25(stem) if kind in ("bm25", "hybrid") else None
    dense = _Dense(embedder or DEFAULT_EMBEDDER, progress=progress) if kind != "bm25" else None
    index = RetrievalIndex(kind, bm25, dense)
    index.add(docs)
    return index


def load_index(path: str, *, embedder: str | None = None, store: str | None = None) -> RetrievalIndex:
    """Open a saved index. `embedder` overrides the recorded model (e.g. the
    same model at another local path); `store` is only used in hints."""
    fs, root = _fs(path)
    store = store or _store_of(str(path))
    if not fs.exists(f"{root}/index.json"):
        raise IndexMissingError(f"no retrieval index at {path}",
                                f"Run `cachegraft index --store {store}` to build it.")
    meta = json.loads(_read(fs, f"{root}/index.json"))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise RetrievalIndexError(f"{path}: not a version-{VERSION} retrieval index", _rebuild_hint(store))
    bm25 = _Bm25.load(fs, root, meta) if meta["kind"] != "dense" else None
    dense = _load_dense(fs, root, meta, embedder) if meta["kind"] != "bm25" else None
    ids, hashes = _passages(fs, root, meta)
    index = RetrievalIndex(meta["kind"], bm25, dense, ids, hashes, meta.get("source"))
    _check_loaded(index, meta, path, store)
    index._fingerprint = meta["fingerprint"]  # index.json is written last and whole: ids and fingerprint agree
    return index


def _passages(fs, root: str, meta: dict) -> tuple[list[str], list[str]]:
    """(ids, content hashes) by row: from passages.bin, or index.json in indexes saved before it."""
    from cachegraft_cli.packed import split_strings, unpack_arrays

    if "ids" in meta:
        return meta["ids"], meta["hashes"]
    try:
        arrays = unpack_arrays(_read(fs, f"{root}/passages.bin"))
    except (FileNotFoundError, ValueError) as exc:
        raise RetrievalIndexError(f"{root}: passages.bin is missing or unreadable ({exc})",
                                  _rebuild_hint(_store_of(root))) from None
    n = meta["passages"]
    return split_strings(arrays["ids"], n), split_strings(arrays["hashes"], n)


def _remove_unlisted_blocks(fs, root: str, keep: list[str]) -> None:
    """Blocks merged away, or written by a save that died before its index.json; and the pre-block file."""
    for path in fs.ls(f"{root}/bm25", detail=False) if fs.exists(f"{root}/bm25") else []:
        if path.rstrip("/").rsplit("/", 1)[-1] not in keep:
            fs.rm(path, recursive=True)
    if keep and fs.exists(f"{root}/bm25.npz"):
        fs.rm(f"{root}/bm25.npz")


def _load_npy(fs, path: str) -> np.ndarray:
    if _is_local(fs):
        return np.load(path, mmap_mode="r", allow_pickle=False)
    return np.load(_io(_read(fs, path)), allow_pickle=False)


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _load_dense(fs, root: str, meta: dict, embedder: str | None) -> _Dense:
    matrix = np.load(_io(_read(fs, f"{root}/dense.npy")), allow_pickle=False)
    return _Dense(embedder or meta["embedder"], matrix)


def _check_loaded(index: RetrievalIndex, meta: dict, path: str, store: str) -> None:
    rows = [len(index.ids), len(index.hashes), meta["passages"]]
    rows += [index._bm25.count()] if index._bm25 else []
    rows += [len(index._dense.matrix)] if index._dense else []
    if len(set(rows)) != 1:
        raise RetrievalIndexError(f"{path}: index files disagree (partly written?)", _rebuild_hint(store))


# ---------------------------------------------------------------- file IO


def _fs(path: str):
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(str(path))
    return fs, root.rstrip("/")


def _io(data: bytes):
    import io

    return io.BytesIO(data)


def _read(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def _write(fs, path: str, data: bytes) -> None:
    """Locally via a temp file and rename: an open memory map of the old file stays valid."""
    if not _is_local(fs):
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    import os
    import uuid

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _write_npy(fs, path: str, array: np.ndarray) -> None:
    buf = _io(b"")
    np.save(buf, array, allow_pickle=False)
    _write(fs, path, buf.getvalue())
