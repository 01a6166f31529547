"""The retrieval index of a store: where it lives, building it, opening it.

The index is kept in `<store>/index/` (replaced atomically: `indexdir`) and
records the segments it covers. An index of an older state of the store (the
store has grown since) is used for what it covers, and `coverage_note` says
how much that is; an index of another passage set is refused.
"""

from __future__ import annotations

import time

from cachegraft_cli.errors import IndexMissingError, NoPassagesError, RetrievalIndexError


def index_path(store_url: str) -> str:
    """The directory of the store's current index (what `load_index` reads)."""
    from cachegraft_cli.indexdir import current

    return current(store_url)


def store_docs(store, segments: list[str] | None = None):
    from cachegraft_cli.retrieval import Doc

    return [Doc(id=r.id, text=r.text, title=r.title, content_hash=r.content_hash) for r in store.rows(segments)]


def segment_names(store) -> list[str]:
    return [s["name"] for s in store.segments]


def store_fingerprint(store) -> str:
    from cachegraft_cli.retrieval import passage_fingerprint

    return passage_fingerprint(store.content_hashes().items())


def build_store_index(store_url: str, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False) -> dict:
    """Build the index, or bring an existing one of the same kind up to date
    (only passages added since are tokenised / embedded)."""
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.retrieval import KINDS, build_index
    from cachegraft_cli.store import CacheStore

    if kind not in KINDS:  # before the store's text is read
        raise UsageError(f"unknown index kind {kind!r}.", f"Use one of: {', '.join(KINDS)}.")
    t0 = time.perf_counter()
    store = CacheStore.open(store_url)
    if not len(store):
        raise NoPassagesError(f"Store {store_url} has no passages to index.", f"Run `cachegraft encode CORPUS --store {store_url}` first.")
    index = None if rebuild else _existing(store_url, kind, embedder)
    names = segment_names(store)
    covered = (index.source or {}).get("segments") if index is not None else None
    if covered is not None and covered == names[:len(covered)]:
        added, mode = index.add(store_docs(store, names[len(covered):])), "updated"  # segments are immutable
    elif index is not None and set(index.ids) <= set(store.ids()):
        added, mode = index.add(store_docs(store)), "updated"
    else:
        index = build_index(store_docs(store), kind, embedder)
        added, mode = len(index), "built"
    index.source = {"segments": names}
    from cachegraft_cli.indexdir import publish

    publish(store_url, index.save)
    return {"store": store_url, "kind": index.kind, "embedder": index.embedder, "passages": len(index),
            "added": added, "mode": mode, "seconds": round(time.perf_counter() - t0, 3)}


def _existing(store_url: str, kind: str, embedder: str | None):
    from cachegraft_cli.retrieval import load_index

    try:
        index = load_index(index_path(store_url), embedder=embedder, store=store_url)
    except IndexMissingError:
        return None
    except RetrievalIndexError:
        return None  # unreadable or old: rebuild from scratch
    same_model = embedder is None or index.embedder in (None, embedder)
    return index if index.kind == kind and same_model else None


def open_index(store, store_url: str, kind: str | None = None, embedder: str | None = None):
    """The store's index, checked against the store's passages: it must cover the store,
    or an older state of it (every indexed passage still stored with the same content)."""
    from cachegraft_cli.retrieval import load_index

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
    return (f"the index of {store_url} covers {len(index):,} of its {len(store):,} passages; answers come from those only "
            f"(run `cachegraft index --store {store_url}` to add the other {missing:,}).")
