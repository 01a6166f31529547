"""The retrieval index of a store: where it lives, building it, opening it.

The index is kept in `<store>/index/` (any URL the store has; see
`engines/files.py` for remote ones), replaced atomically as a new version
(`directory.py`), and records the segments it covers. An index of an older state
of the store (the store has grown since) is used for what it covers, and
`coverage_note` says how much that is; an index of another passage set is
refused.
"""

from __future__ import annotations

import time

from cachegraft_cli.errors import IndexMissingError, NoPassagesError, RetrievalIndexError


def index_path(store_url: str) -> str:
    """The directory of the store's current index (what `load_index` reads)."""
    from cachegraft_cli.retrieval.directory import current

    return current(store_url)


def store_docs(store, segments: list[str] | None = None):
    from cachegraft_cli.retrieval.index import Doc

    return [Doc(id=r.id, text=r.text, title=r.title, content_hash=r.content_hash) for r in store.rows(segments)]


def segment_names(store) -> list[str]:
    return [s["name"] for s in store.segments]


def store_fingerprint(store) -> str:
    from cachegraft_cli.retrieval.index import passage_fingerprint

    return passage_fingerprint(store.content_hashes().items())


def build_store_index(store_url: str, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
                      engines: list[str] | None = None) -> dict:
    """Build the index, or bring an existing one of the same kind (and engines,
    when named) up to date (only passages added since are tokenised / embedded).
    One builder at a time: the index lock is held from reading the current index
    to publishing the new version (`directory.py`)."""
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.retrieval.directory import building, publish, work_near
    from cachegraft_cli.retrieval.index import KINDS, build_index, resolve_engines
    from cachegraft_cli.store import CacheStore

    if kind not in KINDS:  # before the store's text is read
        raise UsageError(f"unknown index kind {kind!r}.", f"Use one of: {', '.join(KINDS)}.")
    t0 = time.perf_counter()
    chosen = resolve_engines(kind, engines)  # bad names fail before the store is read
    store = CacheStore.open(store_url)
    if not len(store):
        raise NoPassagesError(f"Store {store_url} has no passages to index.",
                              f"Run `cachegraft encode CORPUS --store {store_url}` first.")
    with building(store_url):
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
                                near=work_near(store_url))
            added, mode = len(index), "built"
        index.source = {"segments": names}
        publish(store_url, index.save)
    return {"store": store_url, "kind": index.kind, "engines": index.engines, "embedder": index.embedder,
            "passages": len(index),
            "added": added, "mode": mode, "seconds": round(time.perf_counter() - t0, 3)}


def _existing(store_url: str, kind: str, embedder: str | None, engines: dict[str, str] | None):
    from cachegraft_cli.retrieval.index import load_index

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
    """The store's index, checked against the store's passages: it must cover the store,
    or an older state of it (every indexed passage still stored with the same content)."""
    from cachegraft_cli.retrieval.index import load_index

    path = index_path(store_url)
    try:
        index = load_index(path, embedder=embedder, store=store_url)
    except RetrievalIndexError:
        if index_path(store_url) == path:
            raise
        index = load_index(index_path(store_url), embedder=embedder, store=store_url)  # replaced while we read it
    covered = (index.source or {}).get("segments")
    names = segment_names(store)
    if covered != names and not (covered is not None and covered == names[:len(covered)]):
        _check_subset(index, store, store_url)  # same segments, or a prefix of them: same or fewer passages
    return index.view(kind) if kind and kind != index.kind else index


def _check_subset(index, store, store_url: str) -> None:
    hashes = store.content_hashes()
    if len(index.ids) <= len(hashes) and all(hashes.get(pid) == h for pid, h in zip(index.ids, index.hashes)):
        return
    index.check(store_fingerprint(store), len(store), store_url)  # raises: another passage set


def coverage_note(store, index, store_url: str) -> str | None:
    """A warning when the index covers fewer passages than the store holds (an append since)."""
    missing = len(store) - len(index)
    if missing <= 0:
        return None
    return (f"the index of {store_url} covers {len(index):,} of its {len(store):,} passages; answers come from "
            f"those only (run `cachegraft index --store {store_url}` to add the other {missing:,}).")


def index_info(store, store_url: str) -> dict | None:
    """The store's index as `store info` shows it: kind, passages, bytes on disk, and whether it is
    stale (built before the last encode: `cachegraft index` adds the rest); None when there is none."""
    from fsspec.core import url_to_fs

    from cachegraft_cli.retrieval.index import load_index

    path = index_path(store_url)  # one version, read and measured
    try:
        index = load_index(path, store=store_url)
    except IndexMissingError:
        return None
    except RetrievalIndexError as exc:
        return {"kind": None, "problem": exc.message, "stale": True}
    fs, root = url_to_fs(path)
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
