"""`cachegraft store repair`: bring a damaged store back to a consistent one.

`repair` (on request, under the lock):
  1. a missing, unreadable or malformed manifest is rebuilt from the segments on disk: their
     commit records, and the row tables of segments that lost theirs (a commit record is
     written again for each: their rows are checked in step 4 like every other);
  2. listed segments whose row table cannot be read are taken out of the manifest and moved
     into the quarantine (nothing of them can be checked);
  3. `recover` (committed orphans adopted, or deleted when the store holds all of their rows);
  4. `verify`: a manifest entry that disagrees with its segment's commit record and row table
     is written again from them; each segment with rows proven unreadable or failing their
     checksum, or shadowed by a later row of the same id and content, is replaced by a copy
     without those rows (its arrays copied file by file, so the kept caches stay
     bit-identical); a segment repair cannot judge row by row (its row table contradicts
     itself, its arrays do not open, its text does not read) is moved to the quarantine whole.

Nothing is deleted: every segment taken out of the store, and the manifest as it was, go to
`<store>/quarantine/<repair id>/` with `repair.json` (what was moved, created, written), so
`undo` puts the store back as it was. The dropped rows are returned (with their text, when
it is readable) so that the caller can encode them again.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cachegraft_cli.errors import StoreCorruptError, StoreMetadataError
from cachegraft_cli.store import evidence, segments
from cachegraft_cli.store.layout import (
    COMMIT,
    CONTENT,
    MANIFEST,
    ROWS,
    ROWS_BIN,
    array_path,
    new_segment_name,
    now_iso,
    rows_file as layout_rows_file,
    segment_dir,
    segment_file,
    token_extent,
)
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.quarantine import QUARANTINE, Quarantine, undo
from cachegraft_cli.store.recover import merged_from, read_committed, recover, repaired_from
from cachegraft_cli.store.rows import PassageRow, SegmentTable, carry_kept

TOOL = "cachegraft store repair"
__all__ = ["QUARANTINE", "RepairReport", "describe", "rebuild_manifest", "repair", "undo"]


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
    quarantined: dict[str, str] = dataclasses.field(default_factory=dict)  # segment -> why it was moved aside
    unchecked: list[dict] = dataclasses.field(default_factory=list)  # passages moved aside unchecked: kept, not dropped
    entries_fixed: list[str] = dataclasses.field(default_factory=list)
    metadata_restored: list[str] = dataclasses.field(default_factory=list)  # array zarr.json written again
    commits_written: list[str] = dataclasses.field(default_factory=list)
    quarantine: str | None = None  # <store>/quarantine/<id>, when anything was moved or changed
    undo: str | None = None  # the command that undoes this repair
    ok: bool = False
    problems_left: list[dict] = dataclasses.field(default_factory=list)
    dropped_rows: list[PassageRow] = dataclasses.field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("dropped_rows")
        return d


def repair(url, storage_options: dict | None = None, lock=None, drop: list[dict] | None = None) -> RepairReport:
    """Bring a damaged store back to a consistent one (see the module docstring). `drop`: more rows
    to take out as if proven damaged, {passage, segment, reason} each (`store repair --reencode` of
    passages cached with control tokens: they are encoded again right after)."""
    from cachegraft_cli.store.lock import WriterLock
    from cachegraft_cli.store.store import CacheStore, read_meta

    loc = Location.from_url(url, storage_options)
    meta = read_meta(loc)
    held = lock or WriterLock(loc, {"tool": TOOL}).acquire()
    try:
        report = RepairReport(loc.url)
        rows_file = layout_rows_file(meta.get("format_version", 1))
        _check_tables_on_disk(url, loc, meta, rows_file)  # a contradiction stops the repair before any change
        aside = Quarantine(loc)
        report.manifest = _check_manifest(loc, rows_file, aside)
        report.unreadable = _drop_unreadable(loc, rows_file, aside)
        store = CacheStore.open(url, storage_options=storage_options)
        report.metadata_restored = restore_array_metadata(store, aside)
        store = CacheStore.open(url, storage_options=storage_options)
        recovered = recover(store)
        report.adopted, report.retired = recovered["adopted"], recovered["retired"]
        _drop_damaged(CacheStore.open(url, storage_options=storage_options), report, aside, drop or [])
        final = CacheStore.open(url, storage_options=storage_options).verify()
        report.ok, report.problems_left = final["ok"], final["problems"]
        report.quarantined, report.commits_written = dict(aside.log["moved"]), list(aside.log["commits_written"])
        if aside.started:
            report.quarantine, report.undo = loc.path(aside.dir), f"cachegraft store repair {loc.url} --undo {aside.id}"
        return report
    finally:
        if lock is None:
            held.release()


def _check_manifest(loc: Location, rows_file: str, aside: Quarantine) -> str:
    try:
        segments.load_manifest(loc)
        return "ok"
    except StoreCorruptError:
        count = rebuild_manifest(loc, rows_file, aside)
        again = len(aside.log["commits_written"])
        return f"rebuilt from {count} commit records" + (f" ({again} written again from row tables)" if again else "")


def rebuild_manifest(loc: Location, rows_file: str, aside: Quarantine | None = None) -> int:
    """A new manifest listing every readable committed segment in commit order, except
    segments a repair replaced or a compaction merged (those are kept as retired, for the
    grace period, as compaction keeps them). A segment with a readable row table but no
    commit record gets one again and is listed after them; one with neither, or whose
    record disagrees with its table, goes to the quarantine. Returns how many it lists."""
    aside = aside or Quarantine(loc)
    aside.begin()
    found = {name: read_committed(loc, name, rows_file) for name in segments.segment_names(loc)}
    entries = [entry for entry, _ in found.values() if entry is not None]
    replaced = {repaired_from(e) for e in entries}
    merged = {name for e in entries for name in merged_from(e)}
    listed = segments.in_commit_order([e for e in entries if e["name"] not in replaced | merged])
    for name, (entry, _) in found.items():
        if entry is None and name in replaced | merged:  # a source whose deletion was cut short: all held
            aside.move(name, "a source of a merged or repaired segment, found without its commit record")
        elif entry is None:
            adopted = _commit_again(loc, name, rows_file, aside)
            if adopted is not None:
                listed.append(adopted)
    stamp = now_iso()
    retired = [{"name": e["name"], "retired": stamp} for e in entries if e["name"] in merged - replaced]
    manifest = {**segments.empty_manifest(_root_version(loc)), "generation": 1, "segments": listed}
    if retired:
        manifest["retired"] = retired
    loc.write_json_atomic(MANIFEST, manifest)
    return len(listed)


def _root_version(loc: Location) -> int:
    """The store's format version, as its root metadata says (the manifest's must not exceed it)."""
    from cachegraft_cli.store.store import read_meta

    return int(read_meta(loc).get("format_version", 1))


def _commit_again(loc: Location, name: str, rows_file: str, aside: Quarantine) -> dict | None:
    """A commit record written again from a segment's row table (None: moved to the quarantine)."""
    if loc.exists(segment_file(name, COMMIT)):
        aside.move(name, "its commit record disagrees with its row table, or does not read")
        return None
    try:
        (table,) = segments.load_tables(loc, [name], rows_file)
    except StoreCorruptError:
        aside.move(name, f"no commit record, and its {rows_file} does not read")
        return None
    ends = table.offsets + table.tokens
    tokens, extent = int(table.tokens.sum()), int(ends.max()) if len(table) else 0
    entry = {"name": name, "rows": len(table), "tokens": tokens,
             "bytes": {k: loc.size(f"{segment_dir(name)}/{k}") for k in _kinds(loc, name)},
             "committed": now_iso(), "run_info": {"tool": TOOL, "commit_rewritten": True}}
    if extent != tokens:
        entry["token_extent"] = extent
    aside.note("commits_written", name)
    loc.write_json_atomic(segment_file(name, COMMIT), entry)
    return entry


def _kinds(loc: Location, name: str) -> list[str]:
    return [k for k in loc.list_names(segment_dir(name)) if k not in (ROWS, ROWS_BIN, CONTENT, COMMIT)]


def _drop_unreadable(loc: Location, rows_file: str, aside: Quarantine) -> list[str]:
    """Listed segments whose row table does not load: nothing of them can be read or named here.
    Out of the manifest, and what is left of them into the quarantine."""
    manifest = segments.load_manifest(loc)
    _, missing = segments.load_tables_tolerant(loc, [e["name"] for e in manifest["segments"]], rows_file)
    if missing:
        aside.begin()
        _replace_entries(loc, {name: None for name in missing})
        for name, why in missing.items():
            aside.move(name, why)
    return list(missing)


# a row's own damage, proven (or a row the caller asks to drop: "asked")
ROW_PROVEN = {"chunk", "checksum", "shard_missing", "array_short", "duplicate", "asked"}
JUDGED_WHOLE = {"offsets", "rows_mismatch", "arrays", "content"}  # the segment cannot be judged row by row


def _check_tables_on_disk(url, loc: Location, meta: dict, rows_file: str) -> None:
    """Every readable row table and commit record on disk against the root metadata: when they
    contradict it, the root or the segments were edited, and no row can be judged."""
    from cachegraft_cli.store.codecs import get_codec

    codec = get_codec(meta["identity"]["codec"], meta["identity"]["geometry"], meta.get("codec_params"), stored=True)
    spec = evidence.decode_spec(meta, codec)
    for name in segments.segment_names(loc):
        entry, table = read_committed(loc, name, rows_file)
        if entry is not None and table is not None:
            evidence.check_entry(loc.url, entry, spec)
            evidence.check_table(loc.url, table, meta["kinds"], codec.components())


def restore_array_metadata(store, aside: Quarantine) -> list[str]:
    """Write again each array `zarr.json` that contradicts the store's identity, as the writer wrote
    it, where the evidence agrees on what it was: the segment's own commit record names the decode
    spec, or another segment's array of the same part matches the store. The old file is kept in
    the quarantine; the rows' checksums are checked afterwards like every other. Where nothing
    corroborates the root metadata, it is the suspect: `StoreMetadataError`, nothing changed."""
    bad, healthy = [], set()
    for entry, table in zip(store.segments, store.tables):
        if entry["name"] in store.missing:
            continue
        for kind in store.kinds:
            for comp in store.codec.components():
                try:
                    store.array(entry["name"], kind, comp.name)
                    healthy.add((kind, comp.name))
                except StoreMetadataError as exc:
                    bad.append((entry, table, kind, comp, exc))
    restored = []
    for entry, table, kind, comp, refusal in bad:
        corroborated = entry.get(evidence.DECODES) == store.decodes or (kind, comp.name) in healthy
        if not corroborated and not _only_rows_differ(store, entry, table, kind, comp):
            raise refusal
        rows = evidence.expected_rows(comp, entry, table)[1]
        path = f"{array_path(entry['name'], kind, comp.name)}/zarr.json"
        aside.replace_file(path, store.expect.metadata_bytes(comp, rows))
        restored.append(path)
    _check_restored(store, aside, {e["name"]: (e, t) for e, t, *_ in bad})
    return restored


def _check_restored(store, aside: Quarantine, segments_restored: dict) -> None:
    """Every row of a segment whose metadata was written again must check; where one does not, the
    identity itself may be what was edited: the old files go back and nothing is judged."""
    from cachegraft_cli.store.verify import check_written

    for entry, table in segments_restored.values():
        problems = check_written(store, table, entry)
        if problems:
            for item in aside.log["metadata"]:
                kept = f"{aside.dir}/metadata/{item['path']}"
                if store.loc.exists(kept):
                    store.loc.write_bytes_atomic(item["path"], store.loc.read_bytes(kept))
            raise StoreMetadataError(
                f"store {store.loc.url}: segment {entry['name']}'s array metadata contradicts the store's identity, "
                f"and written again as the identity says, its rows do not check ({problems[0]['problem']}); the "
                "old metadata was put back and no row was dropped.",
                hint="The root zarr.json may be what was edited: restore it from a backup, then run "
                     f"`cachegraft store verify {store.loc.url}`.")


def _only_rows_differ(store, entry: dict, table, kind: str, comp) -> bool:
    """Whether an array's metadata agrees with the store but for its length (a shortened shape)."""
    try:
        arr = segments.open_array(store.zarr_store(), array_path(entry["name"], kind, comp.name))
    except Exception:  # noqa: BLE001 - a zarr.json that does not open says nothing either way
        return False
    return evidence.array_problem(store.expect, arr, comp, entry, table, rows=False) is None


def _drop_damaged(store, report: RepairReport, aside: Quarantine, extra: list[dict]) -> None:
    found = store.verify()
    found["problems"] += _asked(store, extra)
    contradictions = [p for p in found["problems"] if p["code"] == "metadata"]
    if contradictions:  # never turned into dropped rows
        segment = contradictions[0]["segment"]
        raise StoreMetadataError(f"store {store.loc.url}: {f'segment {segment}: ' if segment else ''}"
                                 f"{contradictions[0]['problem']}", hint="Restore that file from a backup, then "
                                 f"run `cachegraft store repair {store.loc.url}` again.")
    drop: dict[str, dict[int, str]] = {}
    whole: dict[str, str] = {}
    for p in found["problems"]:
        if p["code"] == "commit_missing":  # listed, so committed: write its record again
            _restore_commit(store, p["segment"], aside)
        elif p["code"] == "entry":
            report.entries_fixed.append(p["segment"])
        elif p["code"] in ROW_PROVEN and p.get("row") is not None:
            drop.setdefault(p["segment"], {}).setdefault(p["row"], p["problem"])
        elif p["code"] in JUDGED_WHOLE or p["code"] == "segment_missing":
            whole.setdefault(p["segment"], p["problem"])
    if report.entries_fixed:
        aside.begin()
        _replace_entries(store.loc, {n: store.loc.read_json(segment_file(n, COMMIT)) for n in report.entries_fixed})
    tables = {t.segment: t for t in store.tables}
    replacements: dict[str, dict | None] = {name: None for name in whole}
    for seg, reasons in drop.items():
        if seg in whole:
            continue
        table = tables[seg]
        kept = _content_rows(store, table)
        for row, reason in sorted(reasons.items()):
            report.dropped.append({"passage": table.ids[row], "segment": seg, "reason": reason})
            if kept is not None and not reason.startswith("duplicate id"):  # a shadowed row is not lost
                report.dropped_rows.append(kept[row])
        replacements[seg] = _rewrite_without(store, table, set(reasons), kept, aside)
    if not replacements:
        return
    aside.begin()
    _replace_entries(store.loc, replacements)
    for seg, why in whole.items():
        report.unchecked += [{"passage": pid, "segment": seg, "reason": why} for pid in tables[seg].ids]
        aside.move(seg, f"{why} (its {len(tables[seg])} passages could not be checked one by one)")
    for seg in drop:
        if seg not in whole:
            new = replacements[seg]
            aside.move(seg, f"replaced by {new['name'] if new else 'nothing'}, without {len(drop[seg])} damaged rows")
    report.rewritten = {seg: (e["name"] if e else None) for seg, e in replacements.items() if seg not in whole}


def _asked(store, extra: list[dict]) -> list[dict]:
    """The caller's rows to drop, as verify's problems (rows of segments no longer listed are skipped)."""
    tables = {t.segment: t for t in store.tables}
    out = []
    for item in extra:
        table = tables.get(item["segment"])
        if table is not None and item["passage"] in table.ids:
            out.append({"segment": item["segment"], "passage": item["passage"], "row": table.ids.index(item["passage"]),
                        "problem": item["reason"], "code": "asked"})
    return out


def _restore_commit(store, name: str, aside: Quarantine) -> None:
    entry = next(e for e in store.segments if e["name"] == name)
    aside.note("commits_written", name)
    store.loc.write_json_atomic(segment_file(name, COMMIT), entry)


def _content_rows(store, table: SegmentTable) -> list[PassageRow] | None:
    try:
        segments.load_content(store.loc, [table])
    except (OSError, StoreCorruptError):
        return None
    return [table.row(i) for i in range(len(table))]


def _rewrite_without(store, table: SegmentTable, drop: set[int], rows: list[PassageRow] | None,
                     aside: Quarantine) -> dict | None:
    """A copy of segment `table` without rows `drop` (None when nothing is left)."""
    keep = [i for i in range(len(table)) if i not in drop]
    if not keep:
        return None
    loc, old = store.loc, table.segment
    new = new_segment_name()
    aside.note("created", new)  # before its first file: `undo` removes it even when the repair stops half-way
    for kind in store.kinds:
        _copy_tree(loc, f"{segment_dir(old)}/{kind}", f"{segment_dir(new)}/{kind}")
    sub = _subset(table, keep, new)
    segments.write_table(loc, sub, store.rows_file)
    content = {name: [getattr(rows[i], name) for i in keep] for name in ("title", "text", "metadata")} if rows else \
        {"title": [""] * len(keep), "text": [""] * len(keep), "metadata": [{} for _ in keep]}
    loc.write_json_atomic(segment_file(new, CONTENT), {"columns": content}, compact=True)
    before = next(e for e in store.segments if e["name"] == old)
    entry = {**before, "name": new, "rows": len(keep), "committed": now_iso(precise=True),
             "order": segments.order_of(before),  # where its source was, for a rebuilt manifest
             "tokens": int(sub.tokens.sum()), "token_extent": token_extent(before),  # the arrays, gaps and all
             "bytes": {k: loc.size(f"{segment_dir(new)}/{k}") for k in store.kinds},
             "run_info": {"tool": TOOL, "repaired_from": old, "dropped": len(drop)}}
    loc.write_json_atomic(segment_file(new, COMMIT), entry)
    return entry


def _subset(table: SegmentTable, keep: list[int], name: str) -> SegmentTable:
    idx = np.asarray(keep, dtype=np.int64)
    subset = SegmentTable(name, [table.ids[i] for i in keep], table.hashes[idx], table.tokens[idx],
                          table.offsets[idx], [table.parents[i] for i in keep], table.chunk_index[idx],
                          list(table.crc_columns), np.ascontiguousarray(table.crcs[idx]))
    return carry_kept(subset, [(table, list(keep))])  # a pruned store stays readable


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
    manifest.update(segments=entries, generation=manifest.get("generation", 0) + 1, updated=now_iso())
    loc.write_json_atomic(MANIFEST, manifest)


def describe(report: RepairReport) -> list[str]:
    """Lines for a person: what was done, passage by passage."""
    lines = []
    if report.manifest != "ok":
        lines.append(f"manifest.json {report.manifest}")
    lines += [f"segment {n}: its row table does not read; taken out of the manifest" for n in report.unreadable]
    lines += [f"segment {n}: the manifest entry disagreed with its commit record; written again from it"
              for n in report.entries_fixed]
    lines += [f"segment {n}: its commit record was missing; written again" for n in report.commits_written]
    lines += [f"{p}: contradicted the store's identity; written again as the writer writes it (the old file is "
              "kept in the quarantine)" for p in report.metadata_restored]
    lines += [f"segment {n}: committed but unlisted; added to the manifest" for n in report.adopted]
    lines += [f"segment {n}: superseded, unlisted; deleted" for n in report.retired]
    lines += [f"dropped passage {d['passage']!r} of segment {d['segment']}: {d['reason']}" for d in report.dropped]
    for old, new in report.rewritten.items():
        lines.append(f"segment {old} replaced by {new}" if new else f"segment {old} removed (nothing left in it)")
    lines += [f"segment {n} moved to the quarantine: {why}" for n, why in report.quarantined.items()]
    lines += [f"passage {u['passage']!r} of segment {u['segment']} could not be checked: kept in the quarantine"
              for u in report.unchecked]
    if report.quarantine:
        lines.append(f"everything taken out is kept in {report.quarantine}; undo this repair with `{report.undo}`")
    return lines


