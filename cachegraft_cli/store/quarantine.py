"""`<store>/quarantine/<id>/`: what one `store repair` took out or replaced, and its undo.

    quarantine/<id>/repair.json         the journal: every change, recorded before it is made
    quarantine/<id>/manifest.json       the manifest as it was before the repair
    quarantine/<id>/segments/<name>/    segments moved out of the store, whole
    quarantine/<id>/metadata/<path>     array metadata files as they were before the repair rewrote them
    quarantine/<id>/index/              the retrieval index as it was before the repair rebuilt it

The journal is written before each change, so a repair killed at any point leaves a
journal that lists everything it did (and perhaps one thing it was about to do):
`undo` completes from there. `undo` deletes only what the journal lists, and refuses
to remove a quarantine that still holds anything else.
"""

from __future__ import annotations

import uuid

from cachegraft_cli.errors import StoreError
from cachegraft_cli.store import segments
from cachegraft_cli.store.layout import COMMIT, MANIFEST, is_temp, now_iso, segment_dir, segment_file
from cachegraft_cli.store.location import Location

QUARANTINE = "quarantine"
JOURNAL = "repair.json"
INDEX = "index"
INDEX_LOCK = "index/lock"


class Quarantine:
    """One repair's quarantine and journal (see the module docstring)."""

    def __init__(self, loc: Location):
        self.loc = loc
        self.id = f"{now_iso().replace(':', '').replace('+0000', 'Z')}-{uuid.uuid4().hex[:6]}"
        self.dir = f"{QUARANTINE}/{self.id}"
        try:
            self.before: bytes | None = loc.read_bytes(MANIFEST)
        except FileNotFoundError:
            self.before = None
        self.log: dict = {"manifest_before": self.before is not None, "manifest_saved": False, "moved": {},
                          "created": [],
                          "commits_written": [], "metadata": [], "index_saved": False}
        self.started = False

    def begin(self) -> None:
        """Before the first change: the journal, then the old manifest aside (atomically, and
        journaled as saved only once it is whole), so that `undo` can put it back."""
        if not self.started:
            self.started = True
            self.save()
            if self.before is not None:
                self.loc.write_bytes_atomic(f"{self.dir}/{MANIFEST}", self.before)
                self.log["manifest_saved"] = True
                self.save()

    def move(self, name: str, why: str) -> None:
        """Move a segment out of the store: journaled first, so a kill between the two leaves
        a journal naming a segment that is in one place or the other, and undo finds it."""
        self.begin()
        self.log["moved"][name] = why
        self.save()
        if self.loc.exists(segment_dir(name)):
            self.loc.move(segment_dir(name), f"{self.dir}/{segment_dir(name)}")

    def note(self, key: str, name: str) -> None:
        """Journal a change about to be made (a segment created, a commit record written)."""
        self.begin()
        self.log[key].append(name)
        self.save()

    def replace_file(self, rel: str, data: bytes) -> None:
        """Replace a metadata file of the store, keeping the old one here (journaled first)."""
        self.begin()
        if self.loc.exists(rel) and not self.loc.exists(f"{self.dir}/metadata/{rel}"):
            self.loc.write_bytes(f"{self.dir}/metadata/{rel}", self.loc.read_bytes(rel))
        existed = self.loc.exists(f"{self.dir}/metadata/{rel}")
        self.log["metadata"].append({"path": rel, "existed": existed})
        self.save()
        self.loc.write_bytes_atomic(rel, data)

    def save(self) -> None:
        self.loc.write_json_atomic(f"{self.dir}/{JOURNAL}", self.log)


def save_index(loc: Location, repair_id: str) -> None:
    """Keep the retrieval index as it is in the quarantine of repair `repair_id` (before the repair
    rebuilds it), so that undo puts it back byte for byte. Journaled once the copy is whole."""
    where = f"{QUARANTINE}/{repair_id}"
    log = loc.read_json(f"{where}/{JOURNAL}")
    if log.get("index_saved") or not loc.exists(INDEX):
        return
    loc.remove(f"{where}/{INDEX}")  # a copy a killed repair began
    for rel in _files(loc, INDEX):
        if rel != INDEX_LOCK and not is_temp(rel):
            loc.write_bytes(f"{where}/{rel}", loc.read_bytes(rel))
    log["index_saved"] = True
    loc.write_json_atomic(f"{where}/{JOURNAL}", log)


def _files(loc: Location, rel: str) -> list[str]:
    root = loc.path(rel)
    return [f"{rel}/{p[len(root):].lstrip('/')}" for p in loc.fs.find(root)]


def undo(url, repair_id: str, storage_options: dict | None = None, lock=None) -> list[str]:
    """Put the store back as it was before repair `repair_id` (see the module docstring). Returns
    lines saying what was done. Safe to run again after a kill: each step checks where things are."""
    from cachegraft_cli.store.lock import WriterLock

    loc = Location.from_url(url, storage_options)
    where = f"{QUARANTINE}/{repair_id}"
    if _never_began(loc, repair_id):
        _remove_quarantine(loc, where)
        return [f"repair {repair_id} was stopped before it changed anything; its empty quarantine was removed"]
    log = _journal(loc, repair_id)
    clash = [n for n in log["moved"] if loc.exists(segment_dir(n)) and loc.exists(f"{where}/{segment_dir(n)}")]
    if clash and not log.get("undone"):
        raise StoreError(f"segment {clash[0]} is in {loc.url}/segments and in the quarantine; nothing was undone.",
                         hint="Move one of them away by hand first.")
    held = lock or WriterLock(loc, {"tool": "cachegraft store repair --undo"}).acquire()
    try:
        lines = [] if log.get("undone") else _undo_steps(loc, where, log)
        log["undone"] = True  # from here on only the quarantine is removed: a second undo just finishes that
        loc.write_json_atomic(f"{where}/{JOURNAL}", log)
        _remove_quarantine(loc, where)
    finally:
        if lock is None:
            held.release()
    return lines


def _never_began(loc: Location, repair_id: str) -> bool:
    """A quarantine holding nothing but temp files: its repair was killed writing its first journal."""
    names = loc.list_names(f"{QUARANTINE}/{repair_id}") if segments.valid_name(repair_id) else []
    return bool(names) and all(is_temp(n) for n in names)


def _journal(loc: Location, repair_id: str) -> dict:
    where = f"{QUARANTINE}/{repair_id}"
    if not segments.valid_name(repair_id) or not loc.exists(f"{where}/{JOURNAL}"):
        known = ", ".join(loc.list_names(QUARANTINE)) or "none"
        raise StoreError(f"{loc.url} has no repair {repair_id!r} to undo (repairs kept there: {known}).",
                         hint=f"Use an id from `ls {loc.path(QUARANTINE)}`.")
    try:
        log = loc.read_json(f"{where}/{JOURNAL}")
        _check_journal(log)
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{loc.url}: the journal of repair {repair_id} does not read ({exc}); nothing was undone.",
                         hint=f"Inspect {loc.path(where)} by hand: nothing in it was deleted.") from None
    return log


def _check_journal(log) -> None:
    if not isinstance(log, dict) or not isinstance(log["moved"], dict) or not all(
            isinstance(log[k], list) for k in ("created", "commits_written")):
        raise ValueError("not a repair journal")
    names = list(log["moved"]) + log["created"] + log["commits_written"]
    if not all(segments.valid_name(n) for n in names):
        raise ValueError("it names something that is not a segment")
    for item in log.get("metadata", []):
        if not isinstance(item, dict) or not _store_file(item.get("path")):
            raise ValueError("it names a metadata file outside the store's segments")


def _store_file(rel) -> bool:
    parts = rel.split("/") if isinstance(rel, str) else []
    return len(parts) > 2 and parts[0] == "segments" and all(p and p not in (".", "..") for p in parts) \
        and parts[-1] == "zarr.json"


def _undo_steps(loc: Location, where: str, log: dict) -> list[str]:
    for name in log["created"]:
        if name not in log["moved"]:
            segments.delete_segment(loc, name)
    for name in log["commits_written"]:
        if name not in log["moved"]:
            loc.remove(segment_file(name, COMMIT))
    for name in log["moved"]:
        if loc.exists(f"{where}/{segment_dir(name)}"):
            loc.move(f"{where}/{segment_dir(name)}", segment_dir(name))
    for item in reversed(log.get("metadata", [])):
        kept = f"{where}/metadata/{item['path']}"
        if loc.exists(kept):
            loc.write_bytes_atomic(item["path"], loc.read_bytes(kept))
        elif not item["existed"]:
            loc.remove(item["path"])
    if not log["manifest_before"]:
        loc.remove(MANIFEST)  # the repair rebuilt one where there was none
    elif log.get("manifest_saved", True):  # journals from before 2026-12-03 saved it before their first entry
        loc.write_bytes_atomic(MANIFEST, loc.read_bytes(f"{where}/{MANIFEST}"))
    # else: stopped before its first change, with the manifest as it was
    folders = ["", *(segment_dir(n) for n in log["commits_written"])]
    folders += [item["path"].rsplit("/", 1)[0] for item in log.get("metadata", [])]
    for folder in folders:  # temp files of the killed repair's atomic writes
        for name in loc.list_names(folder):
            if is_temp(name):
                loc.remove(f"{folder}/{name}" if folder else name)
    index = _restore_index(loc, where) if log.get("index_saved") else []
    repair_id = where.rsplit("/", 1)[-1]
    return [f"removed segment {n} (a copy this repair made)" for n in log["created"]] + \
        [f"moved segment {n} back" for n in log["moved"]] + \
        [f"restored {item['path']} as it was" for item in log.get("metadata", [])] + index + \
        [f"restored manifest.json as it was before repair {repair_id}" if log["manifest_before"]
         else "removed the manifest this repair rebuilt (there was none before)"]


def _restore_index(loc: Location, where: str) -> list[str]:
    """The index directory as it was: everything the repair's rebuild left removed, the kept copy back."""
    from cachegraft_cli.store.lock import WriterLock

    # the index builders' lock (`retrieval.directory`, one floor up, takes the same file): no build runs meanwhile
    held = WriterLock(loc, {"tool": "cachegraft store repair --undo"}, name=INDEX_LOCK).acquire()
    try:
        for name in loc.list_names(INDEX):
            if name != "lock":
                loc.remove(f"{INDEX}/{name}")
        for rel in _files(loc, f"{where}/{INDEX}"):
            loc.write_bytes(rel[len(where) + 1:], loc.read_bytes(rel))
    finally:
        held.release()
    return ["restored the retrieval index as it was before the repair"]


def _remove_quarantine(loc: Location, where: str) -> None:
    """Delete the quarantine, but only what the journal accounts for: anything else in it is kept."""
    stray = loc.list_names(f"{where}/segments")
    if stray:
        raise StoreError(f"{loc.url}: the quarantine {where} still holds segments its journal does not list "
                         f"({', '.join(stray)}); the store was put back, the quarantine was kept.",
                         hint=f"Look at {loc.path(where)}: move those segments back by hand, or delete them if you "
                              "know they are not needed.")
    for rel in (f"{where}/{INDEX}", f"{where}/metadata", f"{where}/{MANIFEST}"):
        loc.remove(rel)
    for name in loc.list_names(where):
        if is_temp(name):
            loc.remove(f"{where}/{name}")
    loc.remove(f"{where}/{JOURNAL}")
    for rel in (where, QUARANTINE):  # the store as it was: no empty folders left behind either
        if not loc.list_names(rel):
            loc.remove(rel)
