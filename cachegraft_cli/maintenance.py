"""`cachegraft store verify` and `store repair` over a whole store: caches, tables, index.

The store's own checks and repairs are in `store/verify.py` and `store/repair.py`;
this adds what needs more than the store: the retrieval index kept with it, and
encoding dropped passages again with the models the store was made with.
"""

from __future__ import annotations

from cachegraft_cli.errors import CacheGraftError


def verify_store(url: str, progress=None) -> dict:
    """The store's verify report plus a check of its retrieval index, when it has one."""
    from cachegraft_cli.store import CacheStore

    store = CacheStore.open(url, partial=True)  # a listed segment that does not read is one of the problems
    report = store.verify(progress)
    _name_lost_passages(store, url, report["problems"])
    from cachegraft_cli.lm.controlcheck import add_control_token_problems

    add_control_token_problems(store, report)  # passages cached with control tokens parsed from their text
    problem = index_problem(store, url)
    if problem:
        report["problems"].append({"segment": None, "passage": None, "row": None, "kind": None, "part": None,
                                   "problem": problem, "code": "index"})
        report["ok"] = False
    return report


def _name_lost_passages(store, url: str, problems: list[dict]) -> None:
    """Segments whose row table is gone cannot name their passages; the retrieval index can: the
    passages it holds that the readable segments lack."""
    lost = [p for p in problems if p["code"] == "segment_missing"]
    if not lost:
        return
    ids = lost_ids(store, url)
    for p in lost:
        p["passages"] = ids
        p["problem"] += (f"; the index names {len(ids)} passages the other segments lack: "
                         f"{', '.join(map(repr, ids[:10]))}{' ...' if len(ids) > 10 else ''}" if ids else
                         "; no index names them")


def lost_ids(store, url: str) -> list[str]:
    """Ids the store's retrieval index holds that no readable segment has (best effort: [] without one)."""
    from cachegraft_cli.retrieval.index import load_index
    from cachegraft_cli.retrieval.stored import index_path

    try:
        index = load_index(index_path(url), store=url)
    except Exception:  # noqa: BLE001 - no index, or one that does not read: nothing to name them from
        return []
    return [pid for pid in index.ids if pid not in store]


def index_problem(store, url: str) -> str | None:
    """Why the index does not serve the store (None when there is no index, or it does)."""
    from cachegraft_cli.errors import IndexMissingError
    from cachegraft_cli.retrieval.directory import root
    from cachegraft_cli.retrieval.stored import open_index

    if not store.loc.exists("index"):
        return None
    try:
        open_index(store, url)
    except IndexMissingError:
        return f"the retrieval index in {root(url)} is incomplete (no index.json)"
    except CacheGraftError as exc:
        return f"the retrieval index does not serve this store: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - any failure to open the index is what verify reports
        return f"the retrieval index does not open: {type(exc).__name__}: {exc}"
    return None


def repair_store(url: str, reencode: bool = False) -> dict:
    """Repair the store (see `store.repair`), encode dropped passages again on request,
    and rebuild its retrieval index when it no longer serves the store."""
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.lock import lock_store
    from cachegraft_cli.store.repair import describe, repair

    with lock_store(url, {"tool": "cachegraft store repair"}) as lock:
        lost, drop = _before_repair(url, reencode)
        report = repair(url, lock=lock, drop=drop)
        result = {**report.as_dict(), "lines": describe(report), "reencoded": [], "not_reencoded": {}}
        for seg in report.unreadable:  # their row tables are gone: the index names what they held
            result["unchecked"] += [{"passage": pid, "segment": seg, "reason": "its row table does not read"}
                                    for pid in lost]
            result["lines"] += [f"passage {pid!r} (named by the index) was in an unreadable segment: not in the store "
                                "now; encode it again from the corpus" for pid in lost]
        if reencode and report.dropped_rows:
            try:
                summary = _reencode(url, report.dropped_rows, lock)
            except CacheGraftError as exc:  # the repair stands; say why the passages could not be encoded
                result["not_reencoded"] = {r.id: exc.message for r in report.dropped_rows}
                result["lines"].append(f"could not encode the dropped passages again: {exc.message}")
            else:
                result["reencoded"] = [r.id for r in report.dropped_rows if r.id not in summary.skipped_reasons]
                result["not_reencoded"] = dict(summary.skipped_reasons)
                result["lines"] += [f"encoded passage {pid!r} again" for pid in result["reencoded"]]
            after = CacheStore.open(url).verify()
            result["ok"], result["problems_left"] = after["ok"], after["problems"]
        if reencode and report.dropped and not report.dropped_rows:
            result["lines"].append("the dropped passages' text is unreadable: encode them again from the corpus")
    repair_id = report.quarantine.rstrip("/").rsplit("/", 1)[-1] if report.quarantine else None
    result["index"] = _rebuild_index(url, keep_for=repair_id)
    if result["index"]:
        result["lines"].append(result["index"])
    return result


def _before_repair(url: str, reencode: bool) -> tuple[list[str], list[dict] | None]:
    """From one open of the store before the repair: the passages of listed segments whose row table
    does not read (as the index names them), and with `reencode` the passages cached with control
    tokens parsed from their text (`lm.controlcheck`), to drop and encode again as plain text."""
    from cachegraft_cli.lm.controlcheck import control_token_rows
    from cachegraft_cli.store.store import CacheStore

    try:
        store = CacheStore.open(url, partial=True)
    except CacheGraftError:  # a lost manifest: the rebuild comes first, names what it finds; a next --reencode
        return [], None
    lost = lost_ids(store, url) if store.missing else []
    if not reencode:
        return lost, None
    return lost, [{"passage": r["passage"], "segment": r["segment"],
                   "reason": f"cached with control tokens parsed from its text ({', '.join(r['tokens'])})"}
                  for r in control_token_rows(store) if "note" not in r]


def undo_repair(url: str, repair_id: str) -> list[str]:
    """Undo one `store repair` (its quarantine id), then rebuild the index if it no longer serves."""
    from cachegraft_cli.store.lock import lock_store
    from cachegraft_cli.store.quarantine import undo

    with lock_store(url, {"tool": "cachegraft store repair --undo"}) as lock:
        lines = undo(url, repair_id, lock=lock)
    try:
        rebuilt = _rebuild_index(url)
    except CacheGraftError as exc:  # the store is back as it was, damage included
        return lines + [f"the store does not open as it is now ({exc.message}); no index was built"]
    return lines + ([rebuilt] if rebuilt else [])


def _reencode(url: str, rows: list, lock):
    from cachegraft_cli.encoding.local import reencode_rows
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.session import ModelSession, stored_choice
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.target import Target

    store = CacheStore.open(url)
    options = EncodeOptions(codec=store.identity["codec"], also_own_cache="own" in store.kinds)
    return reencode_rows(Target.open(url), rows, ModelSession(stored_choice(store.identity).check()), options,
                         lock)


def _rebuild_index(url: str, keep_for: str | None = None) -> str | None:
    """Rebuild the index when it no longer serves the store (repair dropped passages it holds);
    `keep_for`: the repair whose quarantine keeps the index as it was, for its undo."""
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store import CacheStore

    store = CacheStore.open(url)
    problem = index_problem(store, url)
    if problem is None and not store.loc.exists("index") and len(store):
        problem = "there is none"  # deleted, or never built: a store without one cannot answer
    if problem is None:
        return None
    if not len(store):
        return "the store is empty now: no index was built"
    kind, embedder = _index_kind(url)
    if keep_for:
        from cachegraft_cli.store.quarantine import save_index

        save_index(store.loc, keep_for)
    try:
        summary = build_store_index(url, kind, embedder, rebuild=True)
    except CacheGraftError as exc:
        return f"the retrieval index needs a rebuild ({exc.message}): run `cachegraft index --store {url} --rebuild`"
    return f"rebuilt the {summary['kind']} index over {summary['passages']} passages ({problem})"


def _index_kind(url: str) -> tuple[str, str | None]:
    """The kind and embedder of the index there was, when its metadata still reads."""
    import json

    from fsspec.core import url_to_fs

    from cachegraft_cli.retrieval.stored import index_path

    try:
        fs, path = url_to_fs(index_path(url))
        meta = json.loads(fs.cat_file(f"{path.rstrip('/')}/index.json"))
        return meta.get("kind", "bm25"), meta.get("embedder")
    except Exception:  # noqa: BLE001 - an unreadable index is rebuilt as the default kind
        return "bm25", None
