"""Where a store lives: a local directory or any fsspec URL (s3://, memory://, ...).

All non-array IO goes through `Location`: small JSON files, atomic replace,
listing and deletion. Array IO goes through the zarr store from `zarr_store()`.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_LISTED_REMOTELY = ("s3", "s3a", "gs", "gcs")  # object stores whose fsspec filesystems cache listings


@dataclass
class Location:
    url: str
    fs: Any
    root: str
    local: bool
    storage_options: dict = field(default_factory=dict, repr=False)  # may hold credentials: never shown
    _made: set = field(default_factory=set, repr=False)  # directories already created by write_bytes
    raw_url: str = field(default="", repr=False)  # `url` with any user:password@ in it (opened, never shown)

    @classmethod
    def from_url(cls, url: "str | os.PathLike | Location", storage_options: dict | None = None) -> "Location":
        """The location of `url` (a `Location` is taken as it is: a handle parsed once is passed down)."""
        if isinstance(url, Location):
            return url
        from fsspec.core import url_to_fs
        from fsspec.implementations.local import LocalFileSystem

        text = os.fspath(url)
        if "://" not in text:
            text = str(Path(text).expanduser().resolve())
        options = dict(storage_options or {})
        if text.split("://", 1)[0] in _LISTED_REMOTELY:
            # other processes (parallel workers, compaction) add and delete files: never answer from old listings
            options.setdefault("use_listings_cache", False)
        fs, root = url_to_fs(text, **options)
        local = isinstance(fs, LocalFileSystem)
        return cls(redact(text), fs, root.rstrip("/"), local, options, raw_url=text)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def read_many(self, rels: list[str]) -> list[bytes]:
        """Several small files in one batch (concurrent on async filesystems)."""
        if not rels:
            return []
        paths = [self.path(r) for r in rels]
        got = self.fs.cat(paths, on_error="raise")
        return [got[p] for p in paths]

    def write_bytes(self, rel: str, data: bytes | list[bytes]) -> None:
        """One file of `data`, or of pieces written in order: locally one after another (a shard
        is never joined into one more copy: that copy and its fresh pages cost the writer 40-50 us
        a token at Qwen3-0.6B geometry), joined for an object store's single put."""
        parent = self.path(rel).rsplit("/", 1)[0]
        if parent not in self._made:
            self.fs.mkdirs(parent, exist_ok=True)
            self._made.add(parent)
        if isinstance(data, list) and self.local:
            with open(self.path(rel), "wb") as fh:
                for piece in data:
                    fh.write(piece)
            return
        self.fs.pipe_file(self.path(rel), b"".join(data) if isinstance(data, list) else data)

    def write_json_atomic(self, rel: str, obj: Any, compact: bool = False) -> None:
        data = json.dumps(
            obj, ensure_ascii=False, **({"separators": (",", ":")} if compact else {"indent": 1})
        ).encode()
        self.write_bytes_atomic(rel, data)

    def write_bytes_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the old file or the new one, never a torn one.

        Locally: temp file, fsync, rename. Object stores replace whole objects
        atomically, so a plain put is enough there.
        """
        if not self.local:
            self.write_bytes(rel, data)
            return
        final = Path(self.path(rel))
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk must not also leave a torn temp file behind
            raise
        _fsync_dir(final.parent)

    def list_names(self, rel: str) -> list[str]:
        """Names directly under `rel` (empty when it does not exist)."""
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    def remove(self, rel: str) -> None:
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass

    def move(self, src: str, dst: str) -> None:
        """Move a file or directory within the store (one rename locally; copy then delete elsewhere)."""
        target = self.path(dst)
        self.fs.mkdirs(target.rsplit("/", 1)[0], exist_ok=True)
        if self.local:
            os.replace(self.path(src), target)
            return
        self.fs.mv(self.path(src), target, recursive=True)

    def size(self, rel: str) -> int:
        try:
            return int(self.fs.du(self.path(rel), total=True))
        except FileNotFoundError:
            return 0

    def zarr_store(self, read_only: bool):
        if self.local:
            from zarr.storage import LocalStore

            return LocalStore(self.root, read_only=read_only)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(self.raw_url or self.url, storage_options=self.storage_options or None,
                                    read_only=read_only)


def redact(url: str) -> str:
    """A URL fit for messages and logs: credentials written into it (`s3://key:secret@bucket`) are masked."""
    import re

    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/@]*@", r"\1***@", url)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
