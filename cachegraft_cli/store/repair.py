"""`cachegraft store repair`: bring a damaged store back to a consistent one.

`repair` (on request, under the lock):
  1. a missing or unreadable manifest is rebuilt from the segments' commit records;
  2. listed segments whose row table cannot be read are dropped from the manifest;
  3. `recover` (committed orphans adopted, or deleted when superseded or replaced
     by an earlier repair: `run_info.repaired_from`);
  4. `verify`; every segment with damaged rows, or with rows shadowed by a later
     row of the same id, is replaced by a copy without them: its arrays are
     copied file by file (so the kept caches stay bit-identical) under a new
     segment name with a smaller row table; the manifest lists the copy in the
     old one's place, then the old segment is deleted.
The dropped rows are returned (with their text, when it is readable) so that
the caller can encode them again.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cachegraft_cli.errors import StoreCorruptError
from cachegraft_cli.store import segments
from cachegraft_cli.store.layout import (
    COMMIT,
    CONTENT,
    MANIFEST,
    new_segment_name,
    now_iso,
    rows_file as layout_rows_file,
    segment_dir,
    segment_file,
    token_extent,
)
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.recover import read_committed, recover
from cachegraft_cli.store.rows import PassageRow, SegmentTable

TOOL = "cachegraft store repair"


# ---------------------------------------------------------------- repair


@dataclasses.dataclass
class RepairReport:
    url: str
    manifest: str = "ok"  # or "rebuilt from N commit records"
    adopted: list[str] = dataclasses.field(default_factory=list)
    retired: list[str] = dataclasses.field(default_factory=list)
    unreadable: list[str] = dataclasses.field(default_factory=list)
    rewritten: dict[str, str | None] = dataclasses.field(default_factory=dict)
    dropped: list[dict] = dataclasses.field(default_factory=list)
    ok: bool = False
    problems_left: list[dict] = dataclasses.field(default_factory=list)
    dropped_rows: list[PassageRow] = dataclasses.field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("dropped_rows")
        return d


def repair(url, storage_options: dict | None = None, lock=None) -> RepairReport:
    """Bring a damaged store back to a consistent one (see the module docstring)."""
    from cachegraft_cli.store.lock import WriterLock
    from cachegraft_cli.store.store import CacheStore, read_meta

    loc = Location.from_url(url, storage_options)
    meta = read_meta(loc)
    held = lock or WriterLock(loc, {"tool": TOOL}).acquire()
    try:
        report = RepairReport(loc.url)
        rows_file = layout_rows_file(meta.get("format_version", 1))
        report.manifest = _check_manifest(loc, rows_file)
        report.unreadable = _drop_unreadable(loc, rows_file)
        store = CacheStore.open(url, storage_options=storage_options)
        recovered = recover(store)
        report.adopted, report.retired = recovered["adopted"], recovered["retired"]
        _drop_damaged(store, report)
        final = CacheStore.open(url, storage_options=storage_options).verify()
        report.ok, report.problems_left = final["ok"], final["problems"]
        return report
    finally:
        if lock is None:
            held.release()


def _check_manifest(loc: Location, rows_file: str) -> str:
    try:
        segments.load_manifest(loc)
        return "ok"
    except StoreCorruptError:
        count = rebuild_manifest(loc, rows_file)
        return f"rebuilt from {count} commit records"


def rebuild_manifest(loc: Location, rows_file: str) -> int:
    """A new manifest listing every readable committed segment in commit order, except
    segments a repair replaced or a compaction merged (those are kept as retired, for the
    grace period, as compaction keeps them). Returns how many it lists."""
    found = [(name, *read_committed(loc, name, rows_file)) for name in segments.committed_segments(loc)]
    entries = [entry for _, entry, _ in found if entry is not None]
    replaced = {(e.get("run_info") or {}).get("repaired_from") for e in entries}
    merged = {name for e in entries for name in (e.get("run_info") or {}).get("merged", [])}
    listed = sorted((e for e in entries if e["name"] not in replaced | merged),
                    key=lambda e: (str(e.get("committed")), e["name"]))
    stamp = now_iso()
    retired = [{"name": e["name"], "retired": stamp} for e in entries if e["name"] in merged - replaced]
    manifest = {**segments.empty_manifest(), "generation": 1, "segments": listed}
    if retired:
        manifest["retired"] = retired
    loc.write_json_atomic(MANIFEST, manifest)
    return len(listed)


def _drop_unreadable(loc: Location, rows_file: str) -> list[str]:
    """Listed segments whose row table does not load: nothing of them can be read or named."""
    manifest = segments.load_manifest(loc)
    bad = []
    for entry in manifest["segments"]:
        try:
            segments.load_tables(loc, [entry["name"]], rows_file)
        except (OSError, StoreCorruptError):
            bad.append(entry["name"])
    if bad:
        _replace_entries(loc, {name: None for name in bad})
    return bad


def _drop_damaged(store, report: RepairReport) -> None:
    found = store.verify()
    drop: dict[str, dict[int, str]] = {}
    for p in found["problems"]:
        for row in _rows_of(store, p):
            drop.setdefault(p["segment"], {}).setdefault(row, p["problem"])
    if not drop:
        return
    tables = {t.segment: t for t in store.tables}
    replacements: dict[str, dict | None] = {}
    for seg, reasons in drop.items():
        table = tables[seg]
        kept = _content_rows(store, table)
        for row, reason in sorted(reasons.items()):
            report.dropped.append({"passage": table.ids[row], "segment": seg, "reason": reason})
            if kept is not None and not reason.startswith("duplicate id"):  # a shadowed row is not lost
                report.dropped_rows.append(kept[row])
        replacements[seg] = _rewrite_without(store, table, set(reasons), kept)
    _replace_entries(store.loc, replacements)
    for seg in replacements:
        segments.delete_segment(store.loc, seg)
    report.rewritten = {seg: (e["name"] if e else None) for seg, e in replacements.items()}


def _rows_of(store, problem: dict) -> list[int]:
    """Rows a verify problem condemns: its passage's row, or the whole segment."""
    table = next(t for t in store.tables if t.segment == problem["segment"])
    if problem.get("row") is not None:
        return [problem["row"]]
    if problem["code"] == "commit_missing":  # listed, so committed: write its record again
        _restore_commit(store, table.segment)
        return []
    return list(range(len(table)))


def _restore_commit(store, name: str) -> None:
    entry = next(e for e in store.segments if e["name"] == name)
    store.loc.write_json_atomic(segment_file(name, COMMIT), entry)


def _content_rows(store, table: SegmentTable) -> list[PassageRow] | None:
    try:
        segments.load_content(store.loc, [table])
    except (OSError, StoreCorruptError):
        return None
    return [table.row(i) for i in range(len(table))]


def _rewrite_without(store, table: SegmentTable, drop: set[int], rows: list[PassageRow] | None) -> dict | None:
    """A copy of segment `table` without rows `drop` (None when nothing is left)."""
    keep = [i for i in range(len(table)) if i not in drop]
    if not keep:
        return None
    loc, old = store.loc, table.segment
    new = new_segment_name()
    for kind in store.kinds:
        _copy_tree(loc, f"{segment_dir(old)}/{kind}", f"{segment_dir(new)}/{kind}")
    sub = _subset(table, keep, new)
    segments.write_table(loc, sub, store.rows_file)
    content = {name: [getattr(rows[i], name) for i in keep] for name in ("title", "text", "metadata")} if rows else \
        {"title": [""] * len(keep), "text": [""] * len(keep), "metadata": [{} for _ in keep]}
    loc.write_json_atomic(segment_file(new, CONTENT), {"columns": content}, compact=True)
    before = next(e for e in store.segments if e["name"] == old)
    entry = {**before, "name": new, "rows": len(keep), "committed": now_iso(),
             "tokens": int(sub.tokens.sum()), "token_extent": token_extent(before),  # the arrays, gaps and all
             "bytes": {k: loc.size(f"{segment_dir(new)}/{k}") for k in store.kinds},
             "run_info": {"tool": TOOL, "repaired_from": old, "dropped": len(drop)}}
    loc.write_json_atomic(segment_file(new, COMMIT), entry)
    return entry


def _subset(table: SegmentTable, keep: list[int], name: str) -> SegmentTable:
    idx = np.asarray(keep, dtype=np.int64)
    return SegmentTable(name, [table.ids[i] for i in keep], table.hashes[idx], table.tokens[idx], table.offsets[idx],
                        [table.parents[i] for i in keep], table.chunk_index[idx], list(table.crc_columns),
                        np.ascontiguousarray(table.crcs[idx]))


def _copy_tree(loc: Location, src: str, dst: str) -> None:
    """Copy every file under `src` (arrays: metadata and shards), byte for byte."""
    root = loc.path(src)
    for path in loc.fs.find(root):
        rel = path[len(root):].lstrip("/")
        loc.write_bytes(f"{dst}/{rel}", loc.fs.cat_file(path))


def _replace_entries(loc: Location, replacements: dict[str, dict | None]) -> None:
    """One atomic manifest write: each named segment replaced in place by its entry, or removed."""
    manifest = segments.load_manifest(loc)
    entries = []
    for entry in manifest["segments"]:
        if entry["name"] not in replacements:
            entries.append(entry)
        elif replacements[entry["name"]] is not None:
            entries.append(replacements[entry["name"]])
    manifest.update(segments=entries, generation=int(manifest.get("generation", 0)) + 1, updated=now_iso())
    loc.write_json_atomic(MANIFEST, manifest)


def describe(report: RepairReport) -> list[str]:
    """Lines for a person: what was done, passage by passage."""
    lines = []
    if report.manifest != "ok":
        lines.append(f"manifest.json {report.manifest}")
    lines += [f"segment {n}: its row table is unreadable; dropped from the manifest" for n in report.unreadable]
    lines += [f"segment {n}: committed but unlisted; added to the manifest" for n in report.adopted]
    lines += [f"segment {n}: superseded, unlisted; deleted" for n in report.retired]
    lines += [f"dropped passage {d['passage']!r} of segment {d['segment']}: {d['reason']}" for d in report.dropped]
    for old, new in report.rewritten.items():
        lines.append(f"segment {old} replaced by {new}" if new else f"segment {old} removed (nothing left in it)")
    return lines


