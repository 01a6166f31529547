"""OS write failures (disk full, read-only, permissions) as typed errors naming the path.

Stores and indexes are written so that a failed write leaves the last
committed state (see docs/store-format.md); what is left to say is which
path could not be written, why, and that the same command resumes.
"""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager

from cachegraft_cli.errors import CacheGraftError, DiskFullError, StorageError

_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC), errno.EFBIG}
_DENIED = {errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(exc: OSError, path: str, doing: str) -> StorageError:
    """The typed error for `exc`, raised while trying to `doing` at `path`."""
    where = exc.filename or path
    if exc.errno in _FULL:
        return DiskFullError(
            f"no space left on the device while trying to {doing} ({where}).",
            hint="Free some space, or point --store at another disk, and run the same command again: "
            "what was committed is kept and the run resumes from there.")
    if exc.errno in _DENIED:
        return StorageError(
            f"cannot {doing}: {where} is not writable ({exc.strerror}).",
            hint="The store is read-only here: copy it somewhere writable, or run as a user who may write it.")
    if isinstance(exc, NotADirectoryError):
        return StorageError(f"cannot {doing}: a part of {where} is a file, not a directory.",
                            hint="Point --store at a directory.")
    return StorageError(f"cannot {doing} at {where}: {exc.strerror or exc}.", hint="Check the path and the disk.")


@contextmanager
def writing(path: str, doing: str):
    """Turn OS write failures inside the block into `StorageError`s: OSErrors, and the errors
    native libraries (tantivy, in Rust) raise as other exceptions with the OS error in their text."""
    try:
        yield
    except CacheGraftError:
        raise
    except OSError as exc:
        raise write_error(exc, path, doing) from None
    except Exception as exc:  # re-raised unless it carries an OS write failure
        code = errno_in_text(str(exc))
        if code is None:
            raise
        raise write_error(OSError(code, os.strerror(code)), path, doing) from None


_OS_ERROR = re.compile(r"os error (\d+)|No space left on device|Read-only file system|Disk quota exceeded")
_BY_TEXT = {"No space left on device": errno.ENOSPC, "Read-only file system": errno.EROFS,
            "Disk quota exceeded": getattr(errno, "EDQUOT", errno.ENOSPC)}


def errno_in_text(text: str) -> int | None:
    """The write-failure errno a native library's message names (Rust: `... (os error 28)`), or None."""
    for match in _OS_ERROR.finditer(text):
        code = int(match.group(1)) if match.group(1) else _BY_TEXT[match.group(0)]
        if code in _FULL or code in _DENIED:
            return code
    return None
