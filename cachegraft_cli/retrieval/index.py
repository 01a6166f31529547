"""`RetrievalIndex`: search a passage set (BM25, dense or hybrid), add to it, save and load it."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cachegraft_cli.errors import IndexMismatchError, IndexMissingError, NoPassagesError, RetrievalIndexError
from cachegraft_cli.retrieval.dense import DensePart
from cachegraft_cli.retrieval.files import (
    as_stream,
    fs_for,
    read_bytes,
    rebuild_hint,
    store_of,
    write_bytes,
    write_npy,
)
from cachegraft_cli.retrieval.lexical import Bm25Part
from cachegraft_cli.retrieval.ranking import RRF_DEPTH, RRF_K, rrf, top

KINDS = ("bm25", "dense", "hybrid")
DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
FORMAT = "cachegraft-retrieval-index"
VERSION = 1


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


def doc_text(doc: DocLike) -> str:
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


class RetrievalIndex:
    """Search a passage set. Build with `build_index`, reopen with `load_index`."""

    def __init__(self, kind: str, bm25: Bm25Part | None, dense: DensePart | None,
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
            rebuild_hint(store),
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
                self._bm25.set(row, doc_text(doc))
        if self._dense and changed:
            self._dense.set_rows([self._row[d.id] for d in changed], [doc_text(d) for d in changed])
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
            return [self._hits(s, top(s, k, positive=True)) for s in self._bm25_scores(queries)]
        dense = list(self._embedding().scores_many(queries)) if queries else []  # one row of scores per query
        if self.kind == "dense":
            return [self._hits(s, top(s, k)) for s in dense]
        return [self._hybrid(b, d, k) for b, d in zip(self._bm25_scores(queries), dense)]

    def _bm25_scores(self, queries: list[str]) -> list[np.ndarray]:
        bm25 = self._lexical()
        return [bm25.scores(q) for q in queries]

    def _lexical(self) -> Bm25Part:
        if self._bm25 is None:
            raise RetrievalIndexError(f"this {self.kind} index has no BM25 part",
                                      "Rebuild it with --kind bm25 or hybrid.")
        return self._bm25

    def _embedding(self) -> DensePart:
        if self._dense is None:
            raise RetrievalIndexError(f"this {self.kind} index has no embeddings",
                                      "Rebuild it with --kind dense or hybrid.")
        return self._dense

    def _hybrid(self, bm25: np.ndarray, dense: np.ndarray, k: int) -> list[Hit]:
        depth = max(k, RRF_DEPTH)
        fused = rrf([top(bm25, depth, positive=True), top(dense, depth)], len(self.ids))
        return self._hits(fused, top(fused, k, positive=True))

    def _hits(self, scores: np.ndarray, rows: np.ndarray) -> list[Hit]:
        return [Hit(self.ids[r], float(scores[r])) for r in rows]

    # ------------------------------------------------------------ persistence

    def save(self, path: str) -> None:
        """Write to a directory (local or fsspec URL); `index.json` goes last."""
        fs, root = fs_for(path)
        fs.makedirs(root, exist_ok=True)
        if fs.exists(f"{root}/index.json"):
            fs.rm(f"{root}/index.json")
        blocks = self._bm25.save(fs, root) if self._bm25 else None
        if self._dense:
            write_npy(fs, f"{root}/dense.npy", self._dense.matrix)
        from cachegraft_cli.packed import join_strings, pack_arrays

        write_bytes(fs, f"{root}/passages.bin", pack_arrays({"ids": join_strings(self.ids, "id"),
                                                        "hashes": join_strings(self.hashes, "hash")}))
        write_bytes(fs, f"{root}/index.json", json.dumps(self._manifest(blocks), indent=1).encode())
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
    bm25 = Bm25Part(stem) if kind in ("bm25", "hybrid") else None
    dense = DensePart(embedder or DEFAULT_EMBEDDER, progress=progress) if kind != "bm25" else None
    index = RetrievalIndex(kind, bm25, dense)
    index.add(docs)
    return index


def load_index(path: str, *, embedder: str | None = None, store: str | None = None) -> RetrievalIndex:
    """Open a saved index. `embedder` overrides the recorded model (e.g. the
    same model at another local path); `store` is only used in hints."""
    fs, root = fs_for(path)
    store = store or store_of(str(path))
    if not fs.exists(f"{root}/index.json"):
        raise IndexMissingError(f"no retrieval index at {path}",
                                f"Run `cachegraft index --store {store}` to build it.")
    meta = json.loads(read_bytes(fs, f"{root}/index.json"))
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise RetrievalIndexError(f"{path}: not a version-{VERSION} retrieval index", rebuild_hint(store))
    bm25 = Bm25Part.load(fs, root, meta) if meta["kind"] != "dense" else None
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
        arrays = unpack_arrays(read_bytes(fs, f"{root}/passages.bin"))
    except (FileNotFoundError, ValueError) as exc:
        raise RetrievalIndexError(f"{root}: passages.bin is missing or unreadable ({exc})",
                                  rebuild_hint(store_of(root))) from None
    n = meta["passages"]
    return split_strings(arrays["ids"], n), split_strings(arrays["hashes"], n)


def _remove_unlisted_blocks(fs, root: str, keep: list[str]) -> None:
    """Blocks merged away, or written by a save that died before its index.json; and the pre-block file."""
    for path in fs.ls(f"{root}/bm25", detail=False) if fs.exists(f"{root}/bm25") else []:
        if path.rstrip("/").rsplit("/", 1)[-1] not in keep:
            fs.rm(path, recursive=True)
    if keep and fs.exists(f"{root}/bm25.npz"):
        fs.rm(f"{root}/bm25.npz")


def _load_dense(fs, root: str, meta: dict, embedder: str | None) -> DensePart:
    matrix = np.load(as_stream(read_bytes(fs, f"{root}/dense.npy")))
    return DensePart(embedder or meta["embedder"], matrix)


def _check_loaded(index: RetrievalIndex, meta: dict, path: str, store: str) -> None:
    rows = [len(index.ids), len(index.hashes), meta["passages"]]
    rows += [index._bm25.count()] if index._bm25 else []
    rows += [len(index._dense.matrix)] if index._dense else []
    if len(set(rows)) != 1:
        raise RetrievalIndexError(f"{path}: index files disagree (partly written?)", rebuild_hint(store))
