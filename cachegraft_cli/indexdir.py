"""Where a store's retrieval index lives, and replacing it atomically.

    <store>/index/CURRENT      {"version": "v-..."}: the index readers use (replaced atomically)
    <store>/index/v-<...>/     one complete index, as the retrieval engine saves it
    <store>/index/lock         held while an index is built (one builder at a time)

Publishing a new index: under the lock, a fresh version directory is seeded
with the current version's files (hard links locally: nothing is copied, and
the engine replaces files by rename, never writing into one), the engine saves
the new index into it, then CURRENT is replaced (temp file + fsync + rename
locally, one whole-object put on object stores), and only then are other
versions and temp files removed. A kill or a full disk at any point leaves
CURRENT naming a complete index; what a failed build left is removed by the
next one. An index written before versions (`index/index.json`, no CURRENT)
is read in place and replaced by the first publish.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable

from cachegraft_cli.errors import RetrievalIndexError, StoreLockedError
from cachegraft_cli.store.layout import is_temp

CURRENT = "CURRENT"
LOCK = "lock"
_VERSION = re.compile(r"v-[0-9A-Za-z-]+")


def root(store_url) -> str:
    return f"{str(store_url).rstrip('/')}/index"


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
        raise RetrievalIndexError(f"{base}/{CURRENT} is unreadable", "Rebuild the index with `cachegraft index --rebuild`.") from None
    if not isinstance(version, str) or not _VERSION.fullmatch(version):  # a name, never a path
        raise RetrievalIndexError(f"{base}/{CURRENT} names no index version", "Rebuild the index with `cachegraft index --rebuild`.")
    return version


def publish(store_url, save: Callable[[str], None]) -> str:
    """Save a new index with `save(directory)` and make it the current one; returns its directory."""
    from cachegraft_cli.storage import writing

    with writing(root(store_url), "write the retrieval index"), _IndexLock(store_url):
        fs, base = _fs(root(store_url))
        version = f"v-{_stamp()}-{uuid.uuid4().hex[:8]}"
        target = f"{base}/{version}"
        try:
            _seed(fs, _current_dir(fs, base), target)
            save(f"{root(store_url)}/{version}")
            _write_current(fs, base, version)
        except BaseException:
            _remove(fs, target)  # the current index is untouched
            raise
        clean(fs, base, keep=version)
        return f"{root(store_url)}/{version}"


def clean(fs, base: str, keep: str) -> list[str]:
    """Remove everything in the index directory but CURRENT, the lock and version `keep`."""
    removed = []
    for path in fs.ls(base, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if name not in (CURRENT, LOCK, keep):
            _remove(fs, path)
            removed.append(name)
    return removed


def _current_dir(fs, base: str) -> str | None:
    version = _read_current(fs, base)
    if version:
        return f"{base}/{version}"
    return base if fs.exists(f"{base}/index.json") else None


def _seed(fs, source: str | None, target: str) -> None:
    """The current version's files in `target`: unchanged blocks need not be written again."""
    fs.makedirs(target, exist_ok=True)
    if source is None or not _is_local(fs) or not os.path.isdir(source):
        return  # elsewhere (or when the current version is lost) the engine writes every file itself
    for name in os.listdir(source):
        if name in (CURRENT, LOCK) or _VERSION.fullmatch(name) or is_temp(name):
            continue
        _link_tree(os.path.join(source, name), os.path.join(target, name))


def _link_tree(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
        for name in os.listdir(src):
            if not is_temp(name):
                _link_tree(os.path.join(src, name), os.path.join(dst, name))
        return
    try:
        os.link(src, dst)
    except OSError:
        import shutil

        shutil.copy2(src, dst)


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
