"""`cachegraft store compact`: merge runs of small segments into larger ones.

No cache byte changes: a merged segment holds the source segments' encoded
rows as they are (nothing is decoded or re-quantised), one after another in
manifest order, so every passage keeps its checksums. Codecs with token groups
(int4's 128-token key groups) need each source to start on a group boundary:
the gap after a source is filled with zero rows that belong to no passage
(`token_extent` in the entry is then the arrays' length; `tokens` stays the
passages' sum).

Safe to interrupt anywhere, and readers always see a consistent store:

1. under the writer lock, the merged segment is written completely (arrays,
   rows, content, commit.json) while invisible;
2. one atomic manifest replace swaps the run of sources for it, and records
   the sources as `retired` with the time;
3. retired segments stay on disk for `grace_seconds`, so a reader that opened
   the old manifest keeps reading them; a later compaction deletes them.

Killed before 2, the new segment is unlisted and holds nothing the store lacks:
the next writer deletes it (`recover.recover`); killed after 2, the store is
already compacted.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from dataclasses import dataclass

import numpy as np

from cachegraft_cli.errors import StoreCorruptError, StoreError, UsageError
from cachegraft_cli.store import segments, shards
from cachegraft_cli.store.evidence import DECODES
from cachegraft_cli.store.layout import (
    COMMIT,
    CONTENT,
    MANIFEST,
    array_path,
    new_segment_name,
    now_iso,
    segment_dir,
    segment_file,
    token_extent,
)
from cachegraft_cli.store.rows import SegmentTable, carry_kept
from cachegraft_cli.store.verify import check_written

DEFAULT_TARGET_BYTES = 1 << 30
DEFAULT_GRACE_SECONDS = 3600.0
TOOL = "cachegraft store compact"


@dataclass
class CompactOptions:
    target_bytes: int = DEFAULT_TARGET_BYTES  # a merged segment grows until it holds this many stored bytes
    grace_seconds: float = DEFAULT_GRACE_SECONDS  # retired segments are deleted once retired this long

    def __post_init__(self):
        if self.target_bytes < 1 or self.grace_seconds < 0:
            raise UsageError("--target-bytes must be positive and --grace must be >= 0 seconds.")


def compact(url: str, options: CompactOptions | None = None, progress=None,
            storage_options: dict | None = None) -> dict:
    """Merge runs of small segments of the store at `url`; returns a report."""
    from cachegraft_cli.store.lock import WriterLock
    from cachegraft_cli.store.recover import recover
    from cachegraft_cli.store.store import CacheStore

    options = options or CompactOptions()
    start = time.perf_counter()
    store = CacheStore.open(url, storage_options=storage_options)
    lock = WriterLock(store.loc, {"tool": TOOL}).acquire()
    try:
        recover(store)  # as every writer: garbage out, committed orphans in (or out when superseded)
        deleted = purge_retired(store.loc, options.grace_seconds)
        store = CacheStore.open(url, storage_options=storage_options)  # the snapshot under the lock
        before = len(store.segments)
        merged = []
        for group in plan_groups(store.segments, options.target_bytes):
            entry = merge_segments(store, group)
            _swap(store.loc, group, entry)
            merged.append({"into": entry["name"], "from": [e["name"] for e in group], "rows": entry["rows"],
                           "tokens": entry["tokens"]})
            if progress:
                progress(len(merged))
        deleted += purge_retired(store.loc, options.grace_seconds)
    finally:
        lock.release()
    after = len(segments.load_manifest(store.loc)["segments"])
    return {"url": store.loc.url, "segments_before": before, "segments_after": after, "merged": merged,
            "retired_deleted": deleted, "seconds": round(time.perf_counter() - start, 3)}


def plan_groups(entries: list[dict], target_bytes: int) -> list[list[dict]]:
    """Runs of adjacent small segments (under half the target), each cut once it reaches the target;
    runs of one stay. A merged segment is then never small, so compacting again changes nothing."""
    groups: list[list[dict]] = []
    run: list[dict] = []
    size = 0
    for entry in entries:
        nbytes = sum((entry.get("bytes") or {}).values())
        if 2 * nbytes >= target_bytes:
            groups.append(run)
            run, size = [], 0
            continue
        run.append(entry)
        size += nbytes
        if size >= target_bytes:
            groups.append(run)
            run, size = [], 0
    groups.append(run)
    return [g for g in groups if len(g) > 1]


# -- writing the merged segment ------------------------------------------------------


def merge_segments(store, group: list[dict]) -> dict:
    """Write one new, unlisted segment holding `group`'s rows in order, and check that it decodes to
    what its sources claim before anyone can see it; returns its entry. Sources whose metadata
    contradicts the store are refused before anything is written; a merge that does not check is
    deleted again (it was never listed) and nothing of the store changes."""
    for entry in group:  # every source's arrays against the store's identity (`StoreMetadataError`)
        for kind in store.kinds:
            for comp in store.codec.components():
                store.array(entry["name"], kind, comp.name)
    name = new_segment_name()
    try:
        entry, table = _write_merge(store, group, name)
        problems = check_written(store, table, entry)
    except BaseException:
        segments.delete_segment(store.loc, name)
        raise
    if problems:
        segments.delete_segment(store.loc, name)
        first = problems[0]
        where = f"passage {first['passage']!r}" if first.get("passage") else f"segment {name}"
        raise StoreCorruptError(
            f"compaction of {store.loc.url} refused: the merge of {', '.join(e['name'] for e in group)} does not "
            f"read back as its sources claim ({where}: {first['problem']}; {len(problems)} problems); nothing was "
            "swapped or deleted.", hint=f"Run `cachegraft store verify {store.loc.url}` and `cachegraft store repair "
            f"{store.loc.url}` first, then compact again.")
    return entry


def _write_merge(store, group: list[dict], name: str) -> tuple[dict, SegmentTable]:
    loc = store.loc
    comps = store.codec.components()
    tables = segments.load_tables(loc, [e["name"] for e in group], store.rows_file)
    segments.load_content(loc, tables)
    align = math.lcm(*(c.stride for c in comps))
    starts, end = _layout([token_extent(e) for e in group], align)
    for kind in store.kinds:
        for comp in comps:
            _copy_part(store, group, starts, end, name, kind, comp)
    table = _merged_table(name, tables, starts)
    segments.write_table(loc, table, store.rows_file)
    contents = [t.content or {} for t in tables]  # loaded just above
    content = {col: [v for c in contents for v in c[col]] for col in contents[0]}
    loc.write_json_atomic(segment_file(name, CONTENT), {"columns": content}, compact=True)
    entry = _entry(store, name, group, table, end)
    loc.write_json_atomic(segment_file(name, COMMIT), entry)
    return entry, table


def _layout(extents: list[int], align: int) -> tuple[list[int], int]:
    """First token of each source in the merged segment (each on a multiple of `align`), and the end."""
    starts, t = [], 0
    for extent in extents:
        t = -(-t // align) * align
        starts.append(t)
        t += extent
    return starts, t


def _copy_part(store, group, starts, end, name, kind, comp) -> None:
    out = _PartWriter(store, name, kind, comp)
    for entry, start in zip(group, starts):
        src = store.array(entry["name"], kind, comp.name)  # checked against the store (`evidence`)
        rows = comp.rows(0, token_extent(entry))[1]
        if src.shape[0] != rows:
            raise StoreCorruptError(f"segment {entry['name']}: {kind}/{comp.name} has {src.shape[0]} rows, "
                                    f"its entry says {rows}.", hint="Run `cachegraft store verify` for details.")
        out.pad_to(start // comp.stride)
        for lo in range(0, rows, out.per_shard):
            out.append(np.asarray(src[lo: min(lo + out.per_shard, rows)]))
    out.close(comp.rows(0, end)[1])


class _PartWriter:
    """Encoded rows of one component -> whole shards of the new segment (as `StoreWriter` writes them)."""

    def __init__(self, store, segment: str, kind: str, comp):
        self.store, self.comp = store, comp
        self.per_chunk, self.per_shard = segments.chunk_rows(store, comp)
        self.path = array_path(segment, kind, comp.name)
        self.array = segments.create_array(store, self.path, comp)
        self.compressor = shards.numcodecs_compressor(segments.compressor_for(store.compressor, comp.dtype))
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.written = 0  # rows already in shards

    def pad_to(self, row: int) -> None:
        gap = row - self.written - self.buffered
        if gap < 0:
            raise StoreError(f"compaction layout overlaps at row {row} of {self.path}.")
        if gap:
            self.append(np.zeros((gap,) + self.comp.tail, dtype=self.comp.dtype))

    def append(self, rows: np.ndarray) -> None:
        self.buffer.append(rows)
        self.buffered += len(rows)
        while self.buffered >= self.per_shard:
            self._write(self.per_shard)

    def close(self, total_rows: int) -> None:
        self.pad_to(total_rows)
        if self.buffered:
            self._write(self.buffered)
        self.array.resize((total_rows,) + self.comp.tail)

    def _write(self, n: int) -> None:
        block = np.concatenate(self.buffer) if len(self.buffer) > 1 else self.buffer[0]
        pieces = shards.shard_pieces(block[:n], self.per_chunk, self.per_shard // self.per_chunk, self.compressor)
        key = shards.shard_key(self.path, self.written // self.per_shard, 1 + len(self.comp.tail))
        self.store.loc.write_bytes(key, pieces)
        rest = block[n:]
        self.buffer, self.buffered, self.written = ([rest] if len(rest) else []), len(rest), self.written + n


def _merged_table(name: str, tables: list[SegmentTable], starts: list[int]) -> SegmentTable:
    columns = tables[0].crc_columns
    if any(t.crc_columns != columns for t in tables):
        raise StoreCorruptError(f"segments {', '.join(t.segment for t in tables)} name their checksums differently.",
                                hint="Run `cachegraft store verify`; compact only a store one cachegraft wrote.")
    merged = SegmentTable(
        name, [i for t in tables for i in t.ids], np.concatenate([t.hashes for t in tables]),
        np.concatenate([t.tokens for t in tables]), np.concatenate([t.offsets + s for t, s in zip(tables, starts)]),
        [p for t in tables for p in t.parents], np.concatenate([t.chunk_index for t in tables]), list(columns),
        np.concatenate([t.crcs for t in tables]))
    return carry_kept(merged, [(t, list(range(len(t)))) for t in tables])  # a pruned store stays readable


def _entry(store, name: str, group: list[dict], table: SegmentTable, end: int) -> dict:
    tokens = int(table.tokens.sum())
    entry = {"name": name, "rows": len(table), "tokens": tokens,
             "bytes": {k: store.loc.size(f"{segment_dir(name)}/{k}") for k in store.kinds},
             "committed": now_iso(precise=True), "run_info": {"tool": TOOL, "merged": [e["name"] for e in group]},
             "order": segments.order_of(group[0]),  # where its sources were, for a rebuilt manifest
             DECODES: store.decodes}
    if all(e.get("plain_text") for e in group):
        entry["plain_text"] = True
    if end != tokens:
        entry["token_extent"] = end
    return entry


# -- the manifest ---------------------------------------------------------------------


def _swap(loc, group: list[dict], entry: dict) -> None:
    """One atomic replace: the sources out, the merged segment in their place, the sources retired."""
    manifest = segments.load_manifest(loc)
    names = [s["name"] for s in manifest["segments"]]
    sources = [e["name"] for e in group]
    at = names.index(sources[0]) if sources[0] in names else -1
    if at < 0 or names[at: at + len(sources)] != sources:
        raise StoreError(f"the manifest of {loc.url} changed during compaction; nothing was swapped.",
                         hint="Run `cachegraft store compact` again.")
    manifest["segments"][at: at + len(sources)] = [entry]
    stamp = now_iso()
    manifest.setdefault("retired", []).extend({"name": n, "retired": stamp} for n in sources)
    _replace(loc, manifest)


def purge_retired(loc, grace_seconds: float) -> list[str]:
    """Delete segments retired at least `grace_seconds` ago: first out of the manifest, then their files.
    A retired record of a segment the manifest still lists (a hand edit) is dropped and the segment
    kept: a listed segment is never deleted. The manifest schema guarantees the times parse."""
    manifest = segments.load_manifest(loc)
    now = _dt.datetime.now(_dt.UTC)
    listed = {e["name"] for e in manifest["segments"]}
    retired = manifest.get("retired", [])
    old = [r for r in retired
           if (now - segments.parse_time(r["retired"])).total_seconds() >= grace_seconds or r["name"] in listed]
    if not old:
        return []
    manifest["retired"] = [r for r in retired if r not in old]
    _replace(loc, manifest)
    for r in old:  # unlisted now: a kill here leaves a superseded segment that the next writer deletes
        if r["name"] not in listed:
            segments.delete_segment(loc, r["name"])
    return [r["name"] for r in old if r["name"] not in listed]


def _replace(loc, manifest: dict) -> None:
    manifest["generation"] = manifest.get("generation", 0) + 1
    manifest["updated"] = now_iso()
    loc.write_json_atomic(MANIFEST, manifest)
