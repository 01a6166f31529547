"""What every writer does on taking the lock, before it plans or writes.

`recover` (every writer, under the lock): delete uncommitted segments no
manifest lists, then add committed ones that no manifest lists (a writer killed
between its commit record and the manifest) when none of their ids is in the
store yet: roll forward. A committed segment is deleted only when the store
holds all of it already (every row's id with the same content hash: a
compaction killed before its swap), when a repair replaced it, or when it is a
parallel job's worker segment its driver never listed (`store.parallel`); one
that overlaps the store otherwise is left for `repair`.
Segments compaction retired (`manifest["retired"]`) are never touched: readers
of an older manifest use them until their grace period ends.
"""

from __future__ import annotations

from cachegraft_cli.errors import StoreCorruptError
from cachegraft_cli.store import segments
from cachegraft_cli.store.layout import COMMIT, LISTED_BY, segment_file
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.rows import SegmentTable


def recover(store) -> dict:
    """Under the writer lock: garbage out, committed orphans in (or out when the store holds
    them already), the snapshot up to date."""
    removed = segments.collect_garbage(store.loc)
    store.refresh()
    adopted, retired = [], []
    replaced = {repaired_from(e) for e in store.segments}
    for name in orphans(store):
        entry, table = read_committed(store.loc, name, store.rows_file)
        if entry is None or table is None:
            continue  # unreadable: left for `repair` to judge
        if name in replaced or _unlisted_by_driver(entry) or _superseded(store, table):
            segments.delete_segment(store.loc, name)
            retired.append(name)
        elif not any(pid in store for pid in table.ids):
            segments.append_to_manifest(store.loc, entry)
            store.refresh()
            adopted.append(name)
    return {"removed": removed, "adopted": adopted, "retired": retired}


def repaired_from(entry: dict) -> str | None:
    """The segment a repair copied this one from (None when it is no repair's copy)."""
    run_info = entry.get("run_info")
    source = run_info.get("repaired_from") if isinstance(run_info, dict) else None
    return source if isinstance(source, str) else None


def merged_from(entry: dict) -> list[str]:
    """The segments a compaction merged into this one ([] when it is no merge)."""
    run_info = entry.get("run_info")
    sources = run_info.get("merged") if isinstance(run_info, dict) else None
    return [s for s in sources if isinstance(s, str)] if isinstance(sources, list) else []


def _unlisted_by_driver(entry: dict) -> bool:
    """A parallel job's worker segment (`store.parallel`): committed only when its driver lists
    it. Found unlisted under the lock, its job is over; a re-run encodes it again in plan order."""
    run_info = entry.get("run_info")
    return isinstance(run_info, dict) and run_info.get("listed_by") == LISTED_BY


def _superseded(store, table: SegmentTable) -> bool:
    """Whether the store holds every row of `table` already: the same (id, content hash) in a listed
    segment, as the current row or one a later row replaces (compaction merges both, in order)."""
    held = {(pid, t.content_hash(i)) for t in store.tables for i, pid in enumerate(t.ids)}
    return all((pid, table.content_hash(i)) in held for i, pid in enumerate(table.ids))


def orphans(store) -> list[str]:
    """Committed segments the manifest neither lists nor keeps as retired, oldest first."""
    return segments.committed_segments(store.loc, skip=segments.listed_names(segments.load_manifest(store.loc)))


def read_committed(loc: Location, name: str, rows_file: str) -> tuple[dict | None, SegmentTable | None]:
    """(commit record, row table) of a committed segment, or (None, None) when either is unreadable
    or they disagree."""
    try:
        entry = loc.read_json(segment_file(name, COMMIT))
        (table,) = segments.load_tables(loc, [name], rows_file)
    except (OSError, ValueError, StoreCorruptError):
        return None, None
    if not isinstance(entry, dict) or entry.get("name") != name or entry.get("rows") != len(table):
        return None, None
    return entry, table
