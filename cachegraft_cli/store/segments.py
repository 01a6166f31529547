"""Segments: the manifest that lists committed ones, their arrays and tables, garbage."""

from __future__ import annotations

import json

from cachegraft_cli.errors import StoreCorruptError
from cachegraft_cli.store.codecs import Component
from cachegraft_cli.store.layout import (
    COMMIT,
    CONTENT,
    FORMAT_VERSION,
    MANIFEST,
    ROWS,
    SEGMENTS,
    is_temp,
    now_iso,
    segment_dir,
    segment_file,
    zarr_compressors,
)
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.rows import SegmentTable, parse_table, table_to_bin, table_to_json


def empty_manifest() -> dict:
    return {"format_version": FORMAT_VERSION, "generation": 0, "updated": now_iso(), "segments": []}


def load_manifest(loc: Location) -> dict:
    """The committed segments. A missing manifest means an empty store only when no
    segment has a commit record: otherwise it was lost, and nothing may be collected."""
    try:
        manifest = loc.read_json(MANIFEST)
    except FileNotFoundError:
        committed = committed_segments(loc)
        if committed:
            raise StoreCorruptError(
                f"{loc.url}/{MANIFEST} is missing, but {len(committed)} committed segments are on disk.",
                hint=_REPAIR_HINT.format(url=loc.url)) from None
        return empty_manifest()
    except ValueError as exc:
        raise StoreCorruptError(f"{loc.url}/{MANIFEST} is not valid JSON: {exc}.",
                                hint=_REPAIR_HINT.format(url=loc.url)) from None
    if not _well_formed(manifest):
        raise StoreCorruptError(f"{loc.url}/{MANIFEST} does not list segments as a manifest does.",
                                hint=_REPAIR_HINT.format(url=loc.url))
    return manifest


_REPAIR_HINT = "Rebuild it from the segments' commit records with `cachegraft store repair {url}`."


def _well_formed(manifest) -> bool:
    entries = manifest.get("segments") if isinstance(manifest, dict) else None
    return isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("rows"), int)
        and isinstance(e.get("tokens"), int) for e in entries)


def committed_segments(loc: Location, skip: set[str] | frozenset = frozenset()) -> list[str]:
    """Segments on disk with a commit record (complete), except those in `skip` (not even asked
    about: one request per segment counts on object stores)."""
    return [name for name in loc.list_names(SEGMENTS)
            if name != "zarr.json" and name not in skip and loc.exists(segment_file(name, COMMIT))]


def listed_names(manifest: dict) -> set[str]:
    """Segments the manifest names: listed ones, and those compaction retired (kept for readers
    that opened an older manifest until their grace period ends)."""
    return {s["name"] for s in manifest["segments"] + manifest.get("retired", [])}


def append_to_manifest(loc: Location, entry: dict) -> dict:
    """Re-read under the writer lock, add one segment, replace atomically. O(segments)."""
    manifest = load_manifest(loc)
    manifest["segments"].append(entry)
    manifest["generation"] = int(manifest.get("generation", 0)) + 1
    manifest["updated"] = now_iso()
    loc.write_json_atomic(MANIFEST, manifest)
    return manifest


def collect_garbage(loc: Location) -> list[str]:
    """Delete uncommitted segments no manifest lists (left by killed or aborted writers) and temp files.

    A segment with a commit record is never deleted here, listed or not: it is
    complete, and `store.recover.recover` adopts it or deletes it once the store
    holds all of it. Segments compaction retired stay until their grace period
    ends (older readers use them). Only called while holding the writer lock, so
    nothing else is writing.
    """
    listed = listed_names(load_manifest(loc))
    removed = [name for name in loc.list_names(SEGMENTS) if name not in listed and name != "zarr.json"
               and not loc.exists(segment_file(name, COMMIT))]
    for name in removed:
        loc.remove(segment_dir(name))
    for name in loc.list_names(""):
        if is_temp(name):
            loc.remove(name)
    return removed


def delete_segment(loc: Location, name: str) -> None:
    """Commit record first: a deletion cut short leaves an uncommitted segment, which is garbage."""
    if loc.exists(segment_file(name, COMMIT)):
        loc.remove(segment_file(name, COMMIT))
    loc.remove(segment_dir(name))


def load_tables(loc: Location, names: list[str], file: str) -> list[SegmentTable]:
    blobs = loc.read_many([segment_file(n, file) for n in names])
    return [parse_table(name, file, blob) for name, blob in zip(names, blobs)]


def write_table(loc: Location, table: SegmentTable, file: str) -> None:
    if file == ROWS:
        loc.write_json_atomic(segment_file(table.segment, file), table_to_json(table), compact=True)
    else:
        loc.write_bytes_atomic(segment_file(table.segment, file), table_to_bin(table))


def load_content(loc: Location, tables: list[SegmentTable]) -> None:
    missing = [t for t in tables if t.content is None]
    blobs = loc.read_many([segment_file(t.segment, CONTENT) for t in missing])
    for table, blob in zip(missing, blobs):
        try:
            table.content = json.loads(blob)["columns"]
        except (ValueError, KeyError) as exc:
            raise StoreCorruptError(f"segment {table.segment}: {CONTENT} is unreadable ({exc}).",
                                    hint="Run `cachegraft store verify` for details.") from None


def chunk_rows(store, comp: Component) -> tuple[int, int]:
    """(rows per inner chunk, rows per shard) of a component."""
    per_chunk = max(1, store.chunk_tokens // comp.stride)
    return per_chunk, max(per_chunk, store.shard_tokens // comp.stride)


def compressor_for(spec: dict, dtype: str) -> dict:
    """Byte shuffle only means something for multi-byte types."""
    import numpy as np

    if spec["name"] == "blosc" and np.dtype(dtype).itemsize == 1:
        return {**spec, "shuffle": "noshuffle"}
    return spec


def create_array(store, path: str, comp: Component):
    """Metadata only (shape 0); the writer writes whole shards itself and resizes at commit."""
    import zarr
    from zarr.core.array_spec import ArrayConfigParams

    rows_per_chunk, rows_per_shard = chunk_rows(store, comp)
    return zarr.create_array(
        store=store.zarr_store(writable=True),
        name=path,
        shape=(0,) + comp.tail,
        dtype=comp.dtype,
        chunks=(rows_per_chunk,) + comp.tail,
        shards=(rows_per_shard,) + comp.tail,
        compressors=zarr_compressors(compressor_for(store.compressor, comp.dtype), comp.dtype),
        fill_value=0,
        overwrite=True,
        config=ArrayConfigParams(write_empty_chunks=True),
    )


def open_array(zstore, path: str):
    import zarr

    return zarr.open_array(store=zstore, path=path, mode="r", zarr_format=3)
