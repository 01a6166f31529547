"""The single-writer lock, `<store>/writer.lock`.

Local stores: an OS lock (`flock`) on the file, which the kernel drops when
the holder dies, so SIGKILL never leaves a stale lock; the file's content only
says who holds it. Other filesystems: the file itself is the lock, created
with exclusive-create semantics; a dead holder leaves it behind and
`cachegraft store unlock` removes it.
"""

from __future__ import annotations

import json
import os
import socket
from typing import IO

from cachegraft_cli.errors import StoreError, StoreLockedError
from cachegraft_cli.store.layout import LOCK, now_iso
from cachegraft_cli.store.location import Location


def holder_info(run_info: dict | None = None) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": now_iso(), "run": run_info or {}}


def _locked_error(loc: Location, holder: dict | None) -> StoreLockedError:
    who = "an unknown process"
    if holder:
        who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
    return StoreLockedError(
        f"store {loc.url} is being written by {who}.",
        hint="Wait for that writer to finish; if it is dead, remove the lock with `cachegraft store unlock "
             f"{loc.url}`.",
    )


def _parse(data: bytes) -> dict | None:
    try:
        return json.loads(data) if data.strip() else None
    except ValueError:
        return None


class WriterLock:
    """`name` is the lock file under the store (`writer.lock`; the index has its own)."""

    def __init__(self, loc: Location, run_info: dict | None = None, name: str = LOCK):
        self.loc = loc
        self.name = name
        self.info = holder_info(run_info)
        self._fh: IO[bytes] | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> "WriterLock":
        if self.loc.local and _has_flock():
            self._acquire_local()
        else:
            self._acquire_exclusive()
        return self

    def _acquire_local(self) -> None:
        import fcntl

        try:
            fh = open(self.loc.path(self.name), "a+b")
        except OSError as exc:
            from cachegraft_cli.store.oserrors import write_error

            raise write_error(exc, self.loc.path(self.name), "take the writer lock") from None
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fh.seek(0)
            holder = _parse(fh.read())
            fh.close()
            raise _locked_error(self.loc, holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(json.dumps(self.info).encode())
        fh.flush()
        self._fh = fh

    def _acquire_exclusive(self) -> None:
        data = json.dumps(self.info).encode()
        try:
            with self.loc.fs.open(self.loc.path(self.name), "xb") as fh:
                fh.write(data)
        except FileExistsError:
            raise _locked_error(self.loc, read_holder(self.loc, self.name)) from None
        except (NotImplementedError, ValueError):  # filesystem without exclusive create: best effort
            if self.loc.exists(self.name):
                raise _locked_error(self.loc, read_holder(self.loc, self.name)) from None
            self.loc.write_bytes(self.name, data)
            if read_holder(self.loc, self.name) != self.info:
                raise _locked_error(self.loc, read_holder(self.loc, self.name)) from None

    def release(self) -> None:
        if self._fh is not None:
            self._fh.seek(0)
            self._fh.truncate()
            self._fh.close()  # closing drops the flock
            self._fh = None
        elif not (self.loc.local and _has_flock()):
            self.loc.remove(self.name)


def _has_flock() -> bool:
    try:
        import fcntl  # noqa: F401
    except ImportError:
        return False
    return True


def read_holder(loc: Location, name: str = LOCK) -> dict | None:
    try:
        return _parse(loc.read_bytes(name))
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_held(loc: Location, name: str = LOCK) -> bool:
    """Whether a writer holds the lock now (for local stores, asks the OS)."""
    if not (loc.local and _has_flock()):
        return loc.exists(name)
    import fcntl

    try:  # read-only: a reader of a read-only store must not need write access to ask this
        fh = open(loc.path(name), "rb")  # closed by the `with` below
    except OSError:
        return False  # no lock file (nobody ever wrote here), or unreadable
    with fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    return False


def lock_store(url, run_info: dict | None = None, storage_options: dict | None = None) -> WriterLock:
    """Take the writer lock of the store at `url` before anything else happens (models load,
    the store is created): a second writer is refused at once. Makes the directory if needed."""
    loc = Location.from_url(url, storage_options)
    if loc.local:
        try:
            os.makedirs(loc.root, exist_ok=True)
        except OSError as exc:
            from cachegraft_cli.store.oserrors import write_error

            raise write_error(exc, loc.root, "create the store directory") from None
    return WriterLock(loc, run_info).acquire()


def unlock(loc: Location, force: bool = False, name: str = LOCK) -> str:
    """Remove a stale lock (`name`: the writer's, or the index builder's). Refuses while the
    holder is alive on this host."""
    if not is_held(loc, name):
        return "not locked"
    holder = read_holder(loc, name) or {}
    here = holder.get("host") == socket.gethostname()
    if loc.local and _has_flock():
        raise _locked_error(loc, holder)  # an OS lock is only ever held by a live process
    if here and pid_alive(int(holder.get("pid", -1))):
        raise _locked_error(loc, holder)
    if not here and not force:
        raise StoreError(
            f"store {loc.url} is locked by pid {holder.get('pid')} on another host ({holder.get('host')}).",
            hint="Liveness cannot be checked from here; if that writer is surely gone, rerun with --force.",
        )
    loc.remove(name)
    return f"removed lock of pid {holder.get('pid')} on {holder.get('host')}"
