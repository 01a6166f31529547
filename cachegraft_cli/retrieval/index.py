"""Retrieval index over a passage set: BM25, dense, or hybrid, on pluggable engines.

This layer owns what every engine shares: passage ids and content hashes by
row, the tokeniser, the embedding model, hybrid fusion, and the files. The
search itself is an engine's (`cachegraft_cli.retrieval.engines`): `tantivy` for BM25,
`usearch` (HNSW, default) or `flat` (exact) for vectors.

- BM25 over title + text. Tokens: lowercase words of 2+ word characters
  minus bm25s' English stopwords, stemmed with PyStemmer when it is installed
  (recorded in the index; a stemmed index refuses to load without it).
  Passages with score 0 are never returned.
- Dense: a sentence-transformers model (hub id or local directory),
  normalised embeddings, cosine similarity.
- Hybrid: reciprocal-rank fusion, score = sum over the two rankings of
  1 / (60 + rank), each ranking cut at max(k, 100).

Saved as a directory (local path or fsspec URL; `engines/files.py` says how
remote ones are mirrored): `index.json` (format 2, written last: its presence
marks a complete index), `passages.bin` (ids and content hashes by row,
`cachegraft_cli.store.packed` format), `lexical/` and `vectors/` (the engines' own
directories). Format 1 indexes (hand-written BM25 blocks, `dense.npy`) are
refused with a hint to rebuild. Heavy modules are imported inside functions.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
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
VERSION = 2
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
_PARTS = {"bm25": ("terms",), "dense": ("vectors",), "hybrid": ("terms", "vectors")}
_DIRS = {"terms": "lexical", "vectors": "vectors"}


class DocLike(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def text(self) -> str: ...


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
    from cachegraft_cli.retrieval.directory import unversioned

    trimmed = unversioned(path)  # a version directory of the index (`directory.py`)
    return trimmed.rsplit("/", 1)[0] if trimmed.endswith("/index") else trimmed


def _rebuild_hint(store: str) -> str:
    return f"Run `cachegraft index --store {store}` to rebuild it."


# ---------------------------------------------------------------- text -> terms, text -> vectors


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


class _Embedder:
    """A sentence-transformers model by name, loaded on first use; normalised float32 vectors."""

    def __init__(self, name: str, progress: bool = True):
        self.name = name
        self.progress = progress

    def encode(self, texts: list[str], query: bool) -> np.ndarray:
        model = load_embedder(self.name)
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


# ---------------------------------------------------------------- engines


def resolve_engines(kind: str, names: Sequence[str] | None = None) -> dict[str, str]:
    """part ("terms" / "vectors") -> engine name for an index kind: the given names
    where they fit a part of the kind, the defaults elsewhere."""
    from cachegraft_cli.retrieval import engines

    if kind not in KINDS:
        raise RetrievalIndexError(f"unknown index kind {kind!r}", f"Use one of: {', '.join(KINDS)}.")
    chosen = {part: engines.DEFAULTS[part] for part in _PARTS[kind]}
    for name in names or ():
        if name not in engines.NAMES:
            raise RetrievalIndexError(f"unknown retrieval engine {name!r}",
                                      f"Use one of: {', '.join(engines.NAMES)}.")
        part = engines.takes(name)
        if part not in chosen:
            raise RetrievalIndexError(f"engine {name!r} searches {part}, which a {kind} index does not have",
                                      "Pick an engine for the kind's part "
                                      "(tantivy for bm25; usearch or flat for dense).")
        chosen[part] = name
    return chosen


def _import_failure(name: str, err: ImportError) -> RetrievalIndexError:
    return RetrievalIndexError(f"retrieval engine {name!r} cannot load its library ({err})",
                               "Reinstall cachegraft with its dependencies (pip install -e .).")


def _create_engine(name: str, root: Path):
    from cachegraft_cli.retrieval import engines

    try:
        return engines.create(name, root)
    except ImportError as err:
        raise _import_failure(name, err) from None


def _open_engine(name: str, root: Path, params: dict, index_path: str, store: str):
    from cachegraft_cli.retrieval import engines

    try:
        return engines.open_engine(name, root, params)
    except ImportError as err:
        raise _import_failure(name, err) from None
    except (OSError, ValueError, KeyError) as err:  # files missing or damaged
        raise RetrievalIndexError(f"{index_path}: {name} engine files unreadable ({err})",
                                  _rebuild_hint(store)) from None


# ---------------------------------------------------------------- index


class RetrievalIndex:
    """Search a passage set. Build with `build_index`, reopen with `load_index`."""

    def __init__(self, kind: str, tokenizer: _Tokenizer | None, embedder: _Embedder | None,
                 engines: dict[str, Any], home, ids: list[str] | None = None,
                 hashes: list[str] | None = None, source: dict | None = None):
        self.kind = kind
        self._tokenize, self._embedder = tokenizer, embedder
        self._engines = engines  # part -> Engine
        self._home = home  # engines/files.Home: where the engines' files are
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
        return self._embedder.name if self._embedder else None

    @property
    def engines(self) -> dict[str, str]:
        """part -> engine name."""
        return {part: engine.name for part, engine in self._engines.items()}

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = passage_fingerprint(zip(self.ids, self.hashes))
        return self._fingerprint

    def view(self, kind: str) -> RetrievalIndex:
        """The same index searched as another kind it has the parts for
        (a hybrid index also serves `bm25` and `dense`); shares its data."""
        if kind not in KINDS or any(part not in self._engines for part in _PARTS[kind]):
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

    # ------------------------------------------------------------ adding

    def add(self, docs: Sequence[DocLike]) -> int:
        """Add new docs; a known id with new content is replaced, with the same
        content skipped. Only changed docs are tokenised / embedded. Returns
        how many rows were added or replaced."""
        changed = self._changes(docs)
        if not changed:
            return 0
        texts = [_doc_text(d) for d in changed]
        vectors = self._embed(texts, query=False) if "vectors" in self._engines else None  # may fail: before any change
        self._writable()
        rows = [self._row.setdefault(d.id, len(self._row)) for d in changed]
        for doc, row in zip(changed, rows):
            if row == len(self.ids):
                self.ids.append(doc.id)
                self.hashes.append("")
            self.hashes[row] = doc_hash(doc)
        self._fingerprint = None
        if self._tokenize is not None:
            self._engines["terms"].put(rows, [self._tokenize(t) for t in texts])
        if vectors is not None:
            self._engines["vectors"].put(rows, vectors)
        for engine in self._engines.values():
            engine.commit()
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

    def _embed(self, texts: list[str], query: bool) -> np.ndarray:
        assert self._embedder is not None
        vectors = self._embedder.encode(texts, query=query)
        held = self._engines["vectors"].params.get("dim")
        if held is not None and vectors.shape[1] != held:
            raise RetrievalIndexError(
                f"embedding model {self._embedder.name!r} gives {vectors.shape[1]}-dim vectors, "
                f"the index holds {held}-dim ones",
                "Use the model the index was built with, or rebuild the index.",
            )
        return vectors

    def _writable(self) -> None:
        """Changes go to a private work directory, never to a directory others read."""
        if self._home.owned:
            return
        self._home = self._home.work_copy()
        self._engines = {part: _reopen(engine, self._home.path / _DIRS[part]) for part, engine in self._engines.items()}

    # ------------------------------------------------------------ search

    def search(self, query: str, k: int = 5) -> list[Hit]:
        return self.search_many([query], k)[0]

    def search_many(self, queries: Sequence[str], k: int = 5) -> list[list[Hit]]:
        queries = list(queries)
        if k < 1 or not self.ids or not queries:
            return [[] for _ in queries]
        depth = k if self.kind != "hybrid" else max(k, RRF_DEPTH)
        tokenize = self._tokenize
        lexical = self._engines["terms"].search([tokenize(q) for q in queries], depth) \
            if self.kind != "dense" and tokenize is not None else None
        dense = self._engines["vectors"].search(self._embed(queries, query=True), depth) \
            if self.kind != "bm25" else None
        if lexical is None or dense is None:
            return [self._hits(rows, scores) for rows, scores in (lexical or dense or [])]
        return [self._hits(*_rrf([a[0], b[0]], k)) for a, b in zip(lexical, dense)]

    def _hits(self, rows: np.ndarray, scores: np.ndarray) -> list[Hit]:
        return [Hit(self.ids[int(r)], float(s)) for r, s in zip(rows, scores)]

    # ------------------------------------------------------------ persistence

    def save(self, path: str, base: str | None = None) -> None:
        """Write to a directory (local or fsspec URL); `index.json` goes last. `base`: a saved
        index on the same filesystem that a remote save may copy unchanged files from."""
        from cachegraft_cli.store.packed import join_strings, pack_arrays

        self._writable()
        params = {part: engine.commit() for part, engine in self._engines.items()}
        home = self._home.path
        (home / "passages.bin").write_bytes(pack_arrays({"ids": join_strings(self.ids, "id"),
                                                        "hashes": join_strings(self.hashes, "hash")}))
        (home / "index.json").write_text(json.dumps(self._manifest(params), indent=1))
        published = self._home.publish(str(path), base)
        if published is not None:  # a local directory: read from there from now on
            self._engines = {part: _reopen(engine, published.path / _DIRS[part])
                             for part, engine in self._engines.items()}
            self._home = published

    def _manifest(self, params: dict[str, dict]) -> dict[str, Any]:
        vectors = self._engines.get("vectors")
        return {
            "format": FORMAT, "version": VERSION, "kind": self.kind,
            "passages": len(self.ids), "fingerprint": self.fingerprint,
            "stemmer": self._tokenize.stemmer_name if self._tokenize else None,
            "embedder": self.embedder,
            "dim": vectors.params.get("dim") if vectors else None,
            "fusion": {"method": "rrf", "k": RRF_K, "depth": RRF_DEPTH} if self.kind == "hybrid" else None,
            "engines": {part: {"name": self._engines[part].name, "dir": _DIRS[part], "params": p}
                        for part, p in params.items()},
            "source": self.source,  # ids and content hashes are in passages.bin
        }


def _reopen(engine, root: Path):
    return type(engine).open(root, engine.commit())


def _rrf(rankings: list[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows and fused scores of the k best (ties: lower row first)."""
    fused: dict[int, float] = {}
    for ranking in rankings:
        for rank, row in enumerate(ranking.tolist()):
            fused[row] = fused.get(row, 0.0) + 1.0 / (RRF_K + 1 + rank)
    best = sorted(fused.items(), key=lambda item: (-item[1], item[0]))[:k]
    return np.array([r for r, _ in best], np.int64), np.array([s for _, s in best], np.float64)


def build_index(
    docs: Sequence[DocLike],
    kind: str = "bm25",
    embedder: str | None = None,
    *,
    stem: bool | None = None,
    progress: bool = True,
    engines: Sequence[str] | None = None,
    near: str | None = None,
) -> RetrievalIndex:
    """Index docs (anything with id, title, text and optionally content_hash).
    `stem=None` stems when PyStemmer is installed; `embedder` defaults to
    DEFAULT_EMBEDDER for dense/hybrid; `engines` names engines for the kind's
    parts (defaults: `cachegraft_cli.retrieval.engines.DEFAULTS`). The engines work in a
    temporary directory, next to the local path `near` when given (so saving
    there links files instead of copying them)."""
    from cachegraft_cli.retrieval.engines.files import Home

    chosen = resolve_engines(kind, engines)
    if not docs:
        raise NoPassagesError("no passages to index", "Encode a corpus into the store first.")
    home = Home.work(near)
    parts = {part: _create_engine(name, home.path / _DIRS[part]) for part, name in chosen.items()}
    tokenizer = _Tokenizer(stem) if "terms" in parts else None
    dense = _Embedder(embedder or DEFAULT_EMBEDDER, progress=progress) if "vectors" in parts else None
    index = RetrievalIndex(kind, tokenizer, dense, parts, home)
    index.add(docs)
    return index


def load_index(path: str, *, embedder: str | None = None, store: str | None = None) -> RetrievalIndex:
    """Open a saved index. `embedder` overrides the recorded model (e.g. the
    same model at another local path); `store` is only used in hints."""
    from cachegraft_cli.retrieval.engines.files import Home

    store = store or _store_of(str(path))
    home = Home.open(str(path))
    if home is None:
        raise IndexMissingError(f"no retrieval index at {path}", f"Run `cachegraft index --store {store}` to build it.")
    meta = json.loads((home.path / "index.json").read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        found = f"format {meta.get('version')}" if meta.get("format") == FORMAT else "an unknown format"
        raise RetrievalIndexError(f"{path}: {found} retrieval index (this version reads format {VERSION})",
                                  _rebuild_hint(store))
    parts = {part: _open_engine(e["name"], home.path / e["dir"], e["params"], str(path), store)
             for part, e in meta["engines"].items()}
    tokenizer = _Tokenizer(meta["stemmer"] is not None) if "terms" in parts else None
    dense = _Embedder(embedder or meta["embedder"]) if "vectors" in parts else None
    ids, hashes = _passages(home.path, meta)
    index = RetrievalIndex(meta["kind"], tokenizer, dense, parts, home, ids, hashes, meta.get("source"))
    rows = {len(ids), len(hashes), meta["passages"], *(e.rows for e in parts.values())}
    if len(rows) != 1:
        raise RetrievalIndexError(f"{path}: index files disagree (partly written?)", _rebuild_hint(store))
    index._fingerprint = meta["fingerprint"]  # index.json is written last and whole: ids and fingerprint agree
    return index


def _passages(root: Path, meta: dict) -> tuple[list[str], list[str]]:
    """(ids, content hashes) by row, from passages.bin."""
    from cachegraft_cli.store.packed import split_strings, unpack_arrays

    try:
        arrays = unpack_arrays((root / "passages.bin").read_bytes())
    except (FileNotFoundError, ValueError) as exc:
        raise RetrievalIndexError(f"{root}: passages.bin is missing or unreadable ({exc})",
                                  _rebuild_hint(_store_of(str(root)))) from None
    n = meta["passages"]
    return split_strings(arrays["ids"], n), split_strings(arrays["hashes"], n)
