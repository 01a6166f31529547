"""Where an index's files live: a local directory engines work in, mirrored to its URL.

Engines need local files (memory maps, tantivy's directory). A saved index
is a directory at any fsspec URL, like the store it belongs to:

- opened from a local path, the engines read that directory in place;
- opened from another filesystem (s3://, memory://, ...), its files are first
  mirrored into the user cache (`$CACHEGRAFT_HOME/index-mirror/`), fetching
  only files that are new or changed since the last open;
- changes never touch an opened directory: the first change clones it into a
  private work directory (hard links, so O(files), not O(bytes)), and saving
  mirrors the work directory back.

Engine data files are immutable once written (tantivy segments, vector
segments), so mirroring sends only new files plus the small manifests
(`MUTABLE`); `index.json` is removed first and written last, so a reader
never takes a half-mirrored directory for an index.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path

META = "index.json"


def is_mutable(rel: str) -> bool:
    """Files rewritten under the same name: the manifests."""
    return rel.endswith(".json") or rel.rsplit("/", 1)[-1] == "passages.bin"


def _skipped(rel: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return name.endswith(".lock") or ".tmp-" in name


def local_files(root: Path) -> dict[str, int]:
    """Relative path -> size of the files under root (locks and temp files left out)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if not _skipped(rel):
                out[rel] = os.path.getsize(os.path.join(dirpath, name))
    return out


class WorkDir:
    """A private directory, removed when the object that holds it is collected or at exit."""

    def __init__(self, near: Path | None = None):
        parent = Path(near) if near is not None and Path(near).is_dir() else Path(tempfile.gettempdir())
        self.path = parent / f".cachegraft-index-work-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def remove(self) -> None:
        self._finalizer()


def clone(src: Path, dst: Path) -> None:
    """dst gets src's files as hard links (copies where linking fails); manifests are copied."""
    for rel in local_files(src):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(src / rel, target, copy=is_mutable(rel))


def publish_local(home: Path, target: Path) -> None:
    """Mirror home into the local directory target (created if needed)."""
    target.mkdir(parents=True, exist_ok=True)
    (target / META).unlink(missing_ok=True)
    files = local_files(home)
    for rel in files:
        dst = target / rel
        if rel == META or (dst.exists() and not is_mutable(rel) and dst.stat().st_size == files[rel]):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        _link_or_copy(home / rel, tmp, copy=is_mutable(rel))
        os.replace(tmp, dst)
    _remove_stale_local(target, files)
    _put_meta_last(home, target)


def _put_meta_last(home: Path, target: Path) -> None:
    tmp = target / f"{META}.tmp-{uuid.uuid4().hex[:8]}"
    shutil.copyfile(home / META, tmp)
    os.replace(tmp, target / META)


def _remove_stale_local(target: Path, keep: dict[str, int]) -> None:
    for rel in set(local_files(target)) - set(keep) - {META}:
        (target / rel).unlink(missing_ok=True)
    for dirpath, dirnames, names in os.walk(target, topdown=False):
        if dirpath != str(target) and not dirnames and not names:
            os.rmdir(dirpath)


def publish_remote(home: Path, fs, root: str, base: str | None = None) -> None:
    """Mirror home to an fsspec location: new and changed files, stale ones removed, index.json last.
    An engine file that the index at `base` (on the same filesystem) holds already is copied from
    there server-side instead of uploaded (a new version of an index shares most of its files)."""
    fs.makedirs(root, exist_ok=True)
    if fs.exists(f"{root}/{META}"):
        fs.rm(f"{root}/{META}")
    there = remote_files(fs, root)
    old = remote_files(fs, base) if base else {}
    files = local_files(home)
    for rel, size in files.items():
        if rel != META and (is_mutable(rel) or there.get(rel) != size):
            fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            if not is_mutable(rel) and old.get(rel) == size:
                fs.copy(f"{base}/{rel}", f"{root}/{rel}")
            else:
                fs.put_file(str(home / rel), f"{root}/{rel}")
    for rel in set(there) - set(files):
        fs.rm(f"{root}/{rel}")
    fs.put_file(str(home / META), f"{root}/{META}")


def remote_files(fs, root: str) -> dict[str, int]:
    if not fs.exists(root):
        return {}
    found = fs.find(root, detail=True)
    prefix = root.rstrip("/") + "/"
    out = {}
    for path, info in found.items():
        rel = path[len(prefix):] if path.startswith(prefix) else path.lstrip("/")[len(prefix.lstrip("/")):]
        if info.get("type") != "directory" and rel and not _skipped(rel):
            out[rel] = int(info.get("size") or 0)
    return out


def mirror_dir(cache_root: Path, url: str) -> Path:
    """The local mirror of a remote index: one per index (all its versions share it, so opening
    a new version fetches only the files it does not share with the last one)."""
    from cachegraft_cli.retrieval.directory import unversioned

    return cache_root / "index-mirror" / hashlib.sha256(unversioned(url).encode()).hexdigest()[:24]


def fetch(fs, root: str, local: Path) -> None:
    """Bring local up to date with the remote index at root: new or changed files only."""
    local.mkdir(parents=True, exist_ok=True)
    there = remote_files(fs, root)
    here = local_files(local)
    for rel, size in there.items():
        if not is_mutable(rel) and here.get(rel) == size:
            continue
        dst = local / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{dst.name}.tmp-{uuid.uuid4().hex[:8]}")
        fs.get_file(f"{root}/{rel}", str(tmp))
        os.replace(tmp, dst)
    _remove_stale_local(local, {**there, META: 0})
    if META not in there:
        (local / META).unlink(missing_ok=True)


def _link_or_copy(src: Path, dst: Path, copy: bool) -> None:
    if not copy:
        try:
            os.link(src, dst)
            return
        except OSError:
            pass  # another filesystem, or links not supported
    shutil.copyfile(src, dst)


class Home:
    """The local directory an index's engines are in, and whether this process owns it."""

    def __init__(self, path: Path, work: WorkDir | None = None):
        self.path = Path(path)
        self._work = work  # set when the directory is private (a work copy or a fresh build)

    @property
    def owned(self) -> bool:
        return self._work is not None

    @classmethod
    def work(cls, near: str | None = None) -> Home:
        """A fresh private directory; beside the local path `near` when its parent exists."""
        parent = Path(near).parent if near is not None and _local_path(near) else None
        work = WorkDir(parent)
        return cls(work.path, work)

    @classmethod
    def open(cls, url: str) -> Home | None:
        """The saved index at url (mirrored first when remote); None when there is none."""
        fs, root = _fs(url)
        if _local_path(url):
            return cls(Path(root)) if (Path(root) / META).is_file() else None
        if not fs.exists(f"{root}/{META}"):
            return None
        from cachegraft_cli.config import cache_dir

        local = mirror_dir(cache_dir(), url)
        fetch(fs, root, local)
        return cls(local) if (local / META).is_file() else None

    def work_copy(self) -> Home:
        work = WorkDir(self.path.parent)
        clone(self.path, work.path)
        return Home(work.path, work)

    def publish(self, url: str, base: str | None = None) -> Home | None:
        """Mirror to url; for a local url, the Home to read from there on. `base`: a saved index on
        url's filesystem whose unchanged files a remote url gets by server-side copy."""
        fs, root = _fs(url)
        if _local_path(url):
            publish_local(self.path, Path(root))
            return Home(Path(root))
        publish_remote(self.path, fs, root, _fs(base)[1] if base else None)
        return None


def _fs(url: str):
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(str(url))
    return fs, root.rstrip("/")


def _local_path(url: str) -> bool:
    text = str(url)
    return "://" not in text or text.startswith("file://")
