"""File IO of a saved retrieval index (a local directory or an fsspec URL), and the hints that name it."""

from __future__ import annotations

import numpy as np


def store_of(path: str) -> str:
    """The store directory for hints: the parent of an `index` folder."""
    trimmed = path.rstrip("/")
    return trimmed.rsplit("/", 1)[0] if trimmed.endswith("/index") else trimmed


def rebuild_hint(store: str) -> str:
    return f"Run `cachegraft index --store {store}` to rebuild it."


def load_npy(fs, path: str) -> np.ndarray:
    if is_local(fs):
        return np.load(path, mmap_mode="r", allow_pickle=False)
    return np.load(as_stream(read_bytes(fs, path)), allow_pickle=False)


def is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def fs_for(path: str):
    from fsspec.core import url_to_fs

    fs, root = url_to_fs(str(path))
    return fs, root.rstrip("/")


def as_stream(data: bytes):
    import io

    return io.BytesIO(data)


def read_bytes(fs, path: str) -> bytes:
    with fs.open(path, "rb") as f:
        return f.read()


def write_bytes(fs, path: str, data: bytes) -> None:
    """Locally via a temp file and rename: an open memory map of the old file stays valid."""
    if not is_local(fs):
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    import os
    import uuid

    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_npy(fs, path: str, array: np.ndarray) -> None:
    buf = as_stream(b"")
    np.save(buf, array, allow_pickle=False)
    write_bytes(fs, path, buf.getvalue())
