"""The retrieval index of a store: where it lives, building it, opening it.

The index is kept in `<store>/index/` (any URL the store has; see
`engines/files.py` for remote ones) and records the fingerprint of the
passage set it covers; an index that does not match the store is refused.
"""

from __future__ import annotations

import time

from cachegraft_cli.errors import IndexMissingError, NoPassagesError


def index_path(store_url: str) -> str:
    return f"{str(store_url).rstrip('/')}/index"


def store_docs(store, segments: list[str] | None = None):
    from cachegraft_cli.retrieval import Doc

    return [Doc(id=r.id, text=r.text, title=r.title, content_hash=r.content_hash) for r in store.rows(segments)]


def segment_names(store) -> list[str]:
    return [s["name"] for s in store.segments]


def store_fingerprint(store) -> str:
    from cachegraft_cli.retrieval import passage_fingerprint

    return passage_fingerprint(store.content_hashes().items())


def build_store_index(store_url: str, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
                      engines: list[str] | None = None) -> dict:
    """Build the index, or bring an existing one of the same kind (and engines,
    when named) up to date (only passages added since are tokenised / embedded)."""
    from cachegraft_cli.retrieval import build_index, resolve_engines
    from cachegraft_cli.store import CacheStore

    t0 = time.perf_counter()
    chosen = resolve_engines(kind, engines)  # bad names fail before the store is read
    store = CacheStore.open(store_url)
    if not len(store):
        raise NoPassagesError(f"Store {store_url} has no passages to index.",
                              f"Run `cachegraft encode CORPUS --store {store_url}` first.")
    existing = None if rebuild else _existing(store_url, kind, embedder, chosen if engines else None)
    names = segment_names(store)
    covered = (existing.source or {}).get("segments") if existing is not None else None
    if existing is not None and covered is not None and covered == names[:len(covered)]:
        index, mode = existing, "updated"
        added = index.add(store_docs(store, names[len(covered):]))  # segments are immutable
    elif existing is not None and set(existing.ids) <= set(store.ids()):
        index, mode = existing, "updated"
        added = index.add(store_docs(store))
    else:
        index = build_index(store_docs(store), kind, embedder, engines=list(chosen.values()),
                            near=index_path(store_url))
        added, mode = len(index), "built"
    index.source = {"segments": names}
    index.save(index_path(store_url))
    return {"store": store_url, "kind": index.kind, "engines": index.engines, "embedder": index.embedder,
            "passages": len(index),
            "added": added, "mode": mode, "seconds": round(time.perf_counter() - t0, 3)}


def _existing(store_url: str, kind: str, embedder: str | None, engines: dict[str, str] | None):
    from cachegraft_cli.errors import RetrievalIndexError
    from cachegraft_cli.retrieval import load_index

    try:
        index = load_index(index_path(store_url), embedder=embedder, store=store_url)
    except IndexMissingError:
        return None
    except RetrievalIndexError:
        return None  # unreadable or old: rebuild from scratch
    same_model = embedder is None or index.embedder in (None, embedder)
    same_engines = engines is None or index.engines == engines  # unnamed: keep the index's own
    return index if index.kind == kind and same_model and same_engines else None


def open_index(store, store_url: str, kind: str | None = None, embedder: str | None = None):
    """The store's index, checked against the store's passages."""
    from cachegraft_cli.retrieval import load_index

    index = load_index(index_path(store_url), embedder=embedder, store=store_url)
    if (index.source or {}).get("segments") != segment_names(store):  # same segments: same passages
        index.check(store_fingerprint(store), len(store), store_url)
    return index.view(kind) if kind and kind != index.kind else index


def index_info(store, store_url: str) -> dict | None:
    """The store's index as `store info` shows it: kind, passages, bytes on disk, and whether it is
    stale (built before the last encode: `cachegraft index` adds the rest); None when there is none."""
    from fsspec.core import url_to_fs

    from cachegraft_cli.errors import RetrievalIndexError
    from cachegraft_cli.retrieval import load_index

    try:
        index = load_index(index_path(store_url), store=store_url)
    except IndexMissingError:
        return None
    except RetrievalIndexError as exc:
        return {"kind": None, "problem": exc.message, "stale": True}
    fs, root = url_to_fs(index_path(store_url))
    covered = (index.source or {}).get("segments")
    if covered is not None and covered == segment_names(store):
        stale = False
    else:
        stale = index.fingerprint != store_fingerprint(store)
    return {"kind": index.kind, "embedder": index.embedder, "passages": len(index), "store_passages": len(store),
            "bytes": int(fs.du(root)), "stale": stale}


def store_report(store_url: str) -> dict:
    """`CacheStore.info()` plus the retrieval index (`index_info`)."""
    from cachegraft_cli.store import CacheStore

    store = CacheStore.open(store_url)
    return {**store.info(), "index": index_info(store, store_url)}
