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


def empty_manifest(version: int = FORMAT_VERSION) -> dict:
    """A manifest listing nothing, of the root metadata's format `version`."""
    return {"format_version": version, "generation": 0, "updated": now_iso(), "segments": []}


def load_manifest(loc: Location) -> dict:
    """The committed segments. A missing manifest means an empty store only when there are no
    segments: otherwise it was lost, and nothing may be collected. A manifest that does not
    follow the schema (`manifest_problem`) is refused whole, naming the first bad field: a
    writer acting on it could drop or delete segments."""
    try:
        manifest = loc.read_json(MANIFEST)
    except FileNotFoundError:
        on_disk = segment_names(loc)
        if on_disk:
            committed = committed_segments(loc)
            raise StoreCorruptError(
                f"{loc.url}/{MANIFEST} is missing, but {len(on_disk)} segments are on disk "
                f"({len(committed)} with a commit record).", hint=_REPAIR_HINT.format(url=loc.url)) from None
        return empty_manifest()
    except ValueError as exc:
        raise StoreCorruptError(f"{loc.url}/{MANIFEST} is not valid JSON: {exc}.",
                                hint=_REPAIR_HINT.format(url=loc.url)) from None
    problem = manifest_problem(manifest)
    if problem:
        raise StoreCorruptError(f"{loc.url}/{MANIFEST} is not a valid manifest: {problem}.",
                                hint=_REPAIR_HINT.format(url=loc.url))
    return manifest


_REPAIR_HINT = "Rebuild it from the segments' commit records with `cachegraft store repair {url}`."


def segment_names(loc: Location) -> list[str]:
    """Every segment directory on disk, listed or not."""
    return [name for name in loc.list_names(SEGMENTS) if name != "zarr.json" and not is_temp(name)]


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def valid_name(name) -> bool:
    """A segment name is one path component: never empty, `.`-led or holding a separator."""
    return isinstance(name, str) and bool(name) and not name.startswith(".") and name != "zarr.json" \
        and not any(c in name for c in "/\\\0")


def _entry_problem(entry) -> str | None:
    if not isinstance(entry, dict):
        return "is not an object"
    if not valid_name(entry.get("name")):
        return f"has no valid name ({entry.get('name')!r})"
    for key in ("rows", "tokens"):
        if not _count(entry.get(key)):
            return f"has {key}={entry.get(key)!r} (a count >= 0 is required)"
    if "token_extent" in entry and not (_count(entry["token_extent"]) and entry["token_extent"] >= entry["tokens"]):
        return f"has token_extent={entry['token_extent']!r} (a count >= its tokens is required)"
    if not isinstance(entry.get("run_info", {}), dict):
        return f"has run_info={entry['run_info']!r} (an object is required)"
    nbytes = entry.get("bytes", {})
    if not isinstance(nbytes, dict) or not all(isinstance(k, str) and _count(v) for k, v in nbytes.items()):
        return f"has bytes={nbytes!r} (an object of byte counts per cache kind is required)"
    return None


def _retired_problem(record) -> str | None:
    if not isinstance(record, dict) or not valid_name(record.get("name")):
        return "is not {name, retired}"
    if parse_time(record.get("retired")) is None:
        return f"has retired={record.get('retired')!r} (an ISO time with its zone is required)"
    return None


def parse_time(value):
    """An aware datetime from an ISO string, or None."""
    import datetime as dt

    try:
        stamp = dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        return None
    return stamp if stamp is not None and stamp.tzinfo is not None else None


def manifest_problem(manifest) -> str | None:
    """What makes `manifest` unusable (the first problem found), or None when it follows the schema."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("segments"), list):
        return "it does not list segments"
    for key in ("generation", "format_version"):
        if key in manifest and not _count(manifest[key]):
            return f"{key} is {manifest[key]!r} (a count >= 0 is required)"
    if manifest.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:  # the root zarr.json says otherwise
        return f"format_version is {manifest['format_version']}, but the store's is at most {FORMAT_VERSION}"
    seen: set[str] = set()
    for i, entry in enumerate(manifest["segments"]):
        problem = _entry_problem(entry)
        if problem:
            return f"segments[{i}] {problem}"
        if entry["name"] in seen:
            return f"segments[{i}] lists {entry['name']} a second time"
        seen.add(entry["name"])
    retired = manifest.get("retired", [])
    if not isinstance(retired, list):
        return f"retired is {type(retired).__name__}, not a list"
    for i, record in enumerate(retired):
        problem = _retired_problem(record)
        if problem:
            return f"retired[{i}] {problem}"
    return None


def committed_segments(loc: Location, skip: set[str] | frozenset = frozenset()) -> list[str]:
    """Segments on disk with a commit record (complete), except those in `skip` (not even asked
    about: one request per segment counts on object stores)."""
    return [name for name in segment_names(loc) if name not in skip and loc.exists(segment_file(name, COMMIT))]


def order_of(entry: dict) -> dict:
    """When a segment's rows were first committed, for ordering: {"committed": ISO time, "sequence":
    the manifest generation that listed them, where the writer held the lock}. A compaction's or
    repair's copy inherits its source's (`order` in its record), so a rebuilt manifest puts it
    where its source was, not after segments committed since."""
    order = entry.get("order")
    if isinstance(order, dict):
        return order
    return {"committed": entry.get("committed"), "sequence": entry.get("sequence")}


def in_commit_order(entries: list[dict]) -> list[dict]:
    """`entries` in the order their rows were committed: by time (to the microsecond in records
    written since 2026-12-03, to the second before), and exactly by sequence among those that have
    one (a clock that jumps cannot reorder them); the name breaks what is left of a tie."""
    import datetime as dt

    epoch = dt.datetime.min.replace(tzinfo=dt.timezone.utc)

    def key(entry):
        order = order_of(entry)
        return parse_time(order.get("committed")) or epoch, str(entry["name"])

    by_time = sorted(entries, key=key)
    slots = [i for i, e in enumerate(by_time) if _count(order_of(e).get("sequence"))]
    ranked = sorted((by_time[i] for i in slots), key=lambda e: order_of(e)["sequence"])
    for i, entry in zip(slots, ranked):
        by_time[i] = entry
    return by_time


def listed_names(manifest: dict) -> set[str]:
    """Segments the manifest names: listed ones, and those compaction retired (kept for readers
    that opened an older manifest until their grace period ends)."""
    return {s["name"] for s in manifest["segments"] + manifest.get("retired", [])}


def append_to_manifest(loc: Location, entry: dict) -> dict:
    """Re-read under the writer lock, add one segment, replace atomically. O(segments)."""
    manifest = load_manifest(loc)
    manifest["segments"].append(entry)
    manifest["generation"] = manifest.get("generation", 0) + 1
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
    """The row tables of `names`; StoreCorruptError naming the first that does not read."""
    tables, missing = load_tables_tolerant(loc, names, file)
    if missing:
        name, why = next(iter(missing.items()))
        raise StoreCorruptError(f"segment {name} of {loc.url}: {why}.", hint=_REPAIR_HINT.format(url=loc.url))
    return tables


def load_tables_tolerant(loc: Location, names: list[str], file: str) -> tuple[list[SegmentTable], dict[str, str]]:
    """The row tables of `names` (an empty table in place of each that does not read), and why each
    of those did not: {name: reason}. One batch when all read (concurrent on object stores)."""
    try:
        blobs = loc.read_many([segment_file(n, file) for n in names])
        return [parse_table(name, file, blob) for name, blob in zip(names, blobs)], {}
    except (OSError, StoreCorruptError):
        pass  # find which, one by one
    tables, missing = [], {}
    for name in names:
        try:
            tables.append(parse_table(name, file, loc.read_bytes(segment_file(name, file))))
        except FileNotFoundError:
            gone = not loc.exists(segment_dir(name))
            missing[name] = "its directory is missing" if gone else f"its {file} is missing"
            tables.append(empty_table(name))
        except StoreCorruptError:
            missing[name] = f"its {file} does not parse"
            tables.append(empty_table(name))
        except OSError as exc:
            missing[name] = f"its {file} does not read ({exc.strerror or exc})"
            tables.append(empty_table(name))
    return tables, missing


def empty_table(name: str) -> SegmentTable:
    import numpy as np

    none = np.zeros(0, dtype=np.int64)
    return SegmentTable(name, [], np.zeros(0, dtype="S64"), none, none.copy(), [], none.copy(), [],
                        np.zeros((0, 0), dtype=np.uint32))


def write_table(loc: Location, table: SegmentTable, file: str) -> None:
    if file == ROWS:
        loc.write_json_atomic(segment_file(table.segment, file), table_to_json(table), compact=True)
    else:
        loc.write_bytes_atomic(segment_file(table.segment, file), table_to_bin(table))


def load_content(loc: Location, tables: list[SegmentTable]) -> None:
    missing = [t for t in tables if t.content is None]
    try:
        blobs = loc.read_many([segment_file(t.segment, CONTENT) for t in missing])
    except FileNotFoundError as exc:
        raise StoreCorruptError(f"a {CONTENT} of {loc.url} is missing ({exc.filename or exc}).",
                                hint=f"Run `cachegraft store verify {loc.url}` for details.") from None
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
    return create_array_in(store.zarr_store(writable=True), path, store, comp)


def create_array_in(zstore, path: str, store, comp: Component):
    """`create_array` into any zarr store (`evidence` builds the metadata a part should have in memory)."""
    import zarr
    from zarr.core.array_spec import ArrayConfigParams

    rows_per_chunk, rows_per_shard = chunk_rows(store, comp)
    return zarr.create_array(
        store=zstore,
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
