"""Many writers, one commit: segments written in parallel, listed by whoever holds the lock.

A distributed job (the Ray runner) has one driver and many workers. The driver
holds the store's writer lock for the whole job, so no other writer runs and no
garbage collection deletes the workers' unlisted segments. Each worker writes
whole segments with `SegmentWriter`: arrays, rows, content and `commit.json`,
the same bytes a `StoreWriter` writes, but no lock and no manifest. The driver
then lists finished segments with `commit_segments`, one atomic manifest
replace for any number of them. A worker that dies leaves an unlisted segment
(half-written or complete): invisible, and deleted by the next writer (complete
ones too: `recover.recover` adopts only segments whose own writer commits them).
"""

from __future__ import annotations

import json

from cachegraft_cli.errors import StoreError
from cachegraft_cli.store import segments
from cachegraft_cli.store.layout import COMMIT, LISTED_BY, MANIFEST, now_iso, segment_file
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.writer import StoreWriter


class _NotLocked:
    """What a `SegmentWriter` holds instead of the lock: the job's driver holds the real one."""

    def release(self) -> None:
        pass


class SegmentWriter(StoreWriter):
    """Writes one complete segment up to `commit.json` and returns its manifest entry
    from `commit()` without listing it (see `commit_segments`). Its run info says so
    (`listed_by`), so recovery never adopts one its driver did not list."""

    def __init__(self, store, run_info: dict | None = None):
        super().__init__(store, {**(run_info or {}), "listed_by": LISTED_BY})

    def _acquire(self):
        return _NotLocked()  # no lock, and no garbage collection: other workers' segments are in flight

    def _publish(self, entry: dict, table) -> None:
        pass  # the driver lists it; until then it is invisible

    def _sequence(self) -> int | None:
        return None  # the driver, not this worker, holds the lock and decides when it is listed


def commit_segments(loc: Location, entries: list[dict]) -> dict:
    """List finished segments in the manifest, in the given order, in one atomic replace.

    Call only while holding the writer lock. Each segment's `commit.json` must be
    there and agree with its entry, so a half-written segment is never listed.
    Entries already listed are skipped (a retried commit is harmless).
    """
    _check_complete(loc, entries)
    manifest = segments.load_manifest(loc)
    listed = {s["name"] for s in manifest["segments"]}
    new = [e for e in entries if e["name"] not in listed]
    if new:
        manifest["segments"].extend(new)
        manifest["generation"] = manifest.get("generation", 0) + 1
        manifest["updated"] = now_iso()
        loc.write_json_atomic(MANIFEST, manifest)
    return manifest


def _check_complete(loc: Location, entries: list[dict]) -> None:
    blobs = _commit_files(loc, [e["name"] for e in entries])
    for entry, blob in zip(entries, blobs):
        marker = json.loads(blob) if blob is not None else None
        if marker is None or any(marker.get(k) != entry.get(k) for k in ("name", "rows", "tokens")):
            raise StoreError(f"segment {entry['name']} of {loc.url} is not complete (its {COMMIT} is missing or "
                             "disagrees with the worker's report); it was not listed.",
                             hint="Run the same encode again: what is stored is skipped, the rest is redone.")


def _commit_files(loc: Location, names: list[str]) -> list[bytes | None]:
    try:
        return list(loc.read_many([segment_file(n, COMMIT) for n in names]))
    except FileNotFoundError:  # find which one, to name it
        return [loc.read_bytes(segment_file(n, COMMIT)) if loc.exists(segment_file(n, COMMIT)) else None
                for n in names]
