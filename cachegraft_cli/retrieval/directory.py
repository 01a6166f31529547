"""Where a store's retrieval index lives, and replacing it atomically.

    <store>/index/CURRENT      {"version": "v-..."}: the index readers use (replaced atomically)
    <store>/index/v-<...>/     one complete index, as `RetrievalIndex.save` writes it
    <store>/index/lock         held while an index is built (one builder at a time)

Building (`building`): the lock is held from reading the current index to
publishing the new one, and the engines' work directory is made inside
`index/` (`work_near`), so that saving a version links its files instead of
copying them and what a killed builder left is found by the next one.

Publishing (`publish`): the index is saved into a fresh version directory
(locally its unchanged engine files are hard links to the current version's,
through the work copy `engines/files.py` makes; on object stores they are
copied server-side from the current version instead of uploaded again), then
CURRENT is replaced (temp file + fsync + rename locally, one whole-object put
on object stores), and only then are other versions, work directories and
temp files removed. A kill or a full disk at any point leaves CURRENT naming a
complete index; what a failed build left is removed by the next one. An index
written before versions (`index/index.json`, no CURRENT) is read in place and
replaced by the first publish.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cachegraft_cli.errors import RetrievalIndexError, StoreLockedError

CURRENT = "CURRENT"
LOCK = "lock"
_VERSION = re.compile(r"v-[0-9A-Za-z-]+")


def root(store_url) -> str:
    return f"{str(store_url).rstrip('/')}/index"


def unversioned(url) -> str:
    """`url` without a trailing version directory: the index root a version belongs to."""
    return re.sub(r"/v-[0-9A-Za-z-]+$", "", str(url).rstrip("/"))


def current(store_url) -> str:
    """The directory of the index readers use now."""
    fs, base = _fs(root(store_url))
    version = _read_current(fs, base)
    return f"{root(store_url)}/{version}" if version else root(store_url)


def _read_current(fs, base: str) -> str | None:
    try:
        data = fs.cat_file(f"{base}/{CURRENT}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        version = json.loads(data)["version"]
    except (ValueError, KeyError, TypeError):
        raise RetrievalIndexError(f"{base}/{CURRENT} is unreadable",
                                  "Rebuild the index with `cachegraft index --rebuild`.") from None
    if not isinstance(version, str) or not _VERSION.fullmatch(version):  # a name, never a path
        raise RetrievalIndexError(f"{base}/{CURRENT} names no index version",
                                  "Rebuild the index with `cachegraft index --rebuild`.")
    return version


@contextmanager
def building(store_url) -> Iterator[None]:
    """Hold the index lock for a whole build; OS write failures inside become `StorageError`s."""
    from cachegraft_cli.store.oserrors import writing

    with writing(root(store_url), "write the retrieval index"), _IndexLock(store_url):
        yield


def work_near(store_url) -> str:
    """A path for `build_index(near=...)`: its work directory goes into the index directory."""
    return f"{root(store_url)}/{CURRENT}"


def publish(store_url, save: Callable[[str, str | None], None]) -> str:
    """Within `building`: save a new index with `save(directory, base)` (`base`: the current
    version's directory, or None) and make it the current one; returns its directory."""
    fs, base = _fs(root(store_url))
    version = f"v-{_stamp()}-{uuid.uuid4().hex[:8]}"
    target = f"{base}/{version}"
    current_version = _read_current(fs, base)
    previous = f"{root(store_url)}/{current_version}" if current_version else None
    try:
        fs.makedirs(target, exist_ok=True)
        save(f"{root(store_url)}/{version}", previous)
        _write_current(fs, base, version)
    except BaseException:
        _remove(fs, target)  # the current index is untouched
        raise
    clean(fs, base, keep=version)
    return f"{root(store_url)}/{version}"


def clean(fs, base: str, keep: str) -> list[str]:
    """Remove everything in the index directory but CURRENT, the lock and version `keep`: older
    versions, an index from before versions, work directories and temp files of killed builders."""
    removed = []
    for path in fs.ls(base, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name not in (CURRENT, LOCK, keep):
            _remove(fs, path)
            removed.append(name)
    return removed


def _write_current(fs, base: str, version: str) -> None:
    data = json.dumps({"version": version}).encode()
    if not _is_local(fs):
        fs.pipe_file(f"{base}/{CURRENT}", data)  # object stores replace whole objects atomically
        return
    tmp = f"{base}/{CURRENT}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f"{base}/{CURRENT}")
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _IndexLock:
    """One index builder at a time (`index/lock`, the store lock's mechanism)."""

    def __init__(self, store_url):
        from cachegraft_cli.store.location import Location

        self.loc = Location.from_url(store_url)
        self.lock = None

    def __enter__(self):
        from cachegraft_cli.store.lock import WriterLock

        self.loc.fs.makedirs(self.loc.path("index"), exist_ok=True)
        try:
            self.lock = WriterLock(self.loc, {"tool": "cachegraft index"}, name=f"index/{LOCK}").acquire()
        except StoreLockedError as exc:
            raise StoreLockedError(exc.message.replace("is being written by", "has its index being built by"),
                                   hint="Wait for that `cachegraft index` to finish, then run it again.") from None
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.release()


def _stamp() -> str:
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")


def _remove(fs, path: str) -> None:
    try:
        fs.rm(path, recursive=True)
    except FileNotFoundError:
        pass


def _fs(path: str):
    from fsspec.core import url_to_fs

    fs, base = url_to_fs(str(path))
    return fs, base.rstrip("/")


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol
