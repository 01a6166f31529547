"""Fault injection for the reliability tests (no tests here).

`Cli` runs `cachegraft` commands in child processes forked from a server that
has imported torch, transformers and cachegraft once (multiprocessing's
forkserver), so a trial costs a fork and a model load instead of a fresh
interpreter. Each child is a separate process, killed with a real SIGKILL.

`Cli.call` runs a library function the same way (a store writer, a compaction).

Faults a child can be given:
- `kill_at`: SIGKILL itself just before its N-th write step (a store or index
  file written, moved or removed, a rename, a hard link);
- `kill_before` / `stall_before`: SIGKILL itself (or print `STALLED` and sleep,
  for the parent to kill it) just before one named step, `"OP:GLOB[#N]"`: the
  N-th (default first) call of OP on a path matching GLOB, OP one of
  `write_json` (`Location.write_json_atomic`), `write_bytes`, `remove`, `move`
  (store paths; `move` its source) or `replace` (`os.replace`, its destination);
- `disk_budget`: writes under `disk_root` fail with ENOSPC once this many
  bytes have been written there (a full disk);
- `read_only`: writes under `disk_root` fail with EROFS.
"""

from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PRELOAD = ["cachegraft_cli.cli.app", "cachegraft_cli.encoding.plan", "cachegraft_cli.store",
           "cachegraft_cli.retrieval.index", "cachegraft_cli.evaluation.protocol", "cachegraft_cli.evaluation.answerer",
           "cachegraft_cli.answering.ask", "cachegraft_cli.lm.kvcache", "cachegraft_cli.fuser.fusion",
           "cachegraft_cli.lm.models", "cachegraft_cli.lm.generation", "cachegraft_cli.retrieval.engines.tantivy",
           "torch", "transformers", "transformers.modeling_utils", "transformers.masking_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.qwen2.modeling_qwen2", "transformers.generation", "zarr", "numcodecs", "bm25s",
           "tantivy", "tqdm", "rich"]

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when the server imports torch (conftest)
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(PRELOAD)
    return _CTX


@dataclass
class Faults:
    kill_at: int | None = None
    disk_root: str | None = None
    disk_budget: int | None = None
    read_only: bool = False
    env: dict = field(default_factory=dict)
    steps_file: str | None = None  # where the child writes how many write steps it took (when it exits)
    kill_before: str | None = None  # "OP:GLOB[#N]" (see the module's docstring)
    stall_before: str | None = None


@dataclass
class Run:
    proc: object
    out: Path
    err: Path
    started: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float = 300) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
            raise TimeoutError(f"child {self.pid} did not finish in {timeout} s")
        return self.proc.exitcode

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        """Until the child's stdout holds `text` (it reached a point); fails if it exits first."""
        deadline = time.perf_counter() + timeout
        while text not in self.stdout:
            if not self.alive() or time.perf_counter() > deadline:
                raise AssertionError(f"child {self.pid} did not print {text!r}: {self.stdout[-500:]}"
                                     f"{self.stderr[-2000:]}")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace") if self.err.exists() else ""


class Cli:
    """Start `cachegraft ARGS` in forked children; outputs go to files under `logs`."""

    def __init__(self, logs: Path):
        self.logs = Path(logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def start(self, *args, faults: Faults | None = None, cwd: str | None = None) -> Run:
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        proc = _context().Process(target=_child, args=([str(a) for a in args], str(out), str(err), faults or Faults(),
                                                       cwd, sys.path[:]))
        proc.start()
        return Run(proc, out, err, time.perf_counter())

    def run(self, *args, faults: Faults | None = None, cwd: str | None = None, timeout: float = 300) -> tuple[int, Run]:
        run = self.start(*args, faults=faults, cwd=cwd)
        return run.wait(timeout), run

    def call(self, func, *args, faults: Faults | None = None) -> Run:
        """Start `func(*args)` (a module-level function, arguments that pickle) in a forked child."""
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        proc = _context().Process(target=_call_child, args=(func, args, str(out), str(err), faults or Faults(),
                                                            sys.path[:]))
        proc.start()
        return Run(proc, out, err, time.perf_counter())


def _redirect(path: list[str], out: str, err: str) -> None:
    sys.path[:] = path
    for name, fd in ((out, 1), (err, 2)):
        handle = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)


def _call_child(func, args: tuple, out: str, err: str, faults: Faults, path: list[str]) -> None:
    _redirect(path, out, err)
    os.environ.update(faults.env)
    _install(faults)
    func(*args)


def _child(argv: list[str], out: str, err: str, faults: Faults, cwd: str | None, path: list[str]) -> None:
    _redirect(path, out, err)
    os.environ.update(faults.env)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if cwd:
        os.chdir(cwd)
    _install(faults)
    sys.argv = ["cachegraft", *argv]
    from cachegraft_cli.cli.app import main

    try:
        main()
    finally:
        if faults.steps_file:
            Path(faults.steps_file).write_text(str(_Steps.count))


# ---------------------------------------------------------------- hooks


class _Steps:
    count = 0
    kill_at: int | None = None

    @classmethod
    def tick(cls) -> None:
        cls.count += 1
        if cls.kill_at is not None and cls.count >= cls.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def _install(faults: Faults) -> None:
    if faults.kill_at is not None or faults.steps_file:
        _Steps.kill_at = faults.kill_at
        _count_write_steps()
    if faults.disk_root and (faults.disk_budget is not None or faults.read_only):
        _limit_disk(os.path.realpath(faults.disk_root), faults.disk_budget, faults.read_only)
    if faults.kill_before:
        _before_step(faults.kill_before, lambda: os.kill(os.getpid(), signal.SIGKILL))
    if faults.stall_before:
        _before_step(faults.stall_before, _stall)


def _stall() -> None:
    print("STALLED", flush=True)
    time.sleep(120)  # the parent kills the child meanwhile


def _before_step(spec: str, action) -> None:
    """Run `action` just before the step `spec` names ("OP:GLOB[#N]", see the module's docstring)."""
    from cachegraft_cli.store.location import Location

    op, _, rest = spec.partition(":")
    pattern, _, nth = rest.partition("#")
    owner, name = {"write_json": (Location, "write_json_atomic"), "write_bytes": (Location, "write_bytes"),
                   "remove": (Location, "remove"), "move": (Location, "move"), "replace": (os, "replace")}[op]
    real, seen = getattr(owner, name), [0]

    def check(path) -> None:
        if fnmatch.fnmatchcase(str(path), pattern):
            seen[0] += 1
            if seen[0] == int(nth or 1):
                action()

    if owner is os:
        def hooked_os(src, dst, *a, **k):
            check(dst)
            return real(src, dst, *a, **k)

        setattr(os, name, hooked_os)
    else:
        def hooked(self, rel, *a, **k):
            check(rel)
            return real(self, rel, *a, **k)

        setattr(owner, name, hooked)


def _count_write_steps() -> None:
    """Every store or index write passes one of these: a file written whole, moved or removed, a rename, a link."""
    from cachegraft_cli.store.location import Location

    for name in ("write_bytes", "write_bytes_atomic", "move", "remove"):
        real = getattr(Location, name)

        def counted(self, *a, _real=real, **k):
            _Steps.tick()
            return _real(self, *a, **k)

        setattr(Location, name, counted)
    for name in ("replace", "link"):
        real = getattr(os, name)

        def counted_os(*a, _real=real, **k):
            _Steps.tick()
            return _real(*a, **k)

        setattr(os, name, counted_os)
    import zarr.storage

    real_set = zarr.storage.LocalStore.set

    async def counted_set(self, key, value, *a, **k):
        _Steps.tick()
        return await real_set(self, key, value, *a, **k)

    zarr.storage.LocalStore.set = counted_set


class _Disk:
    root = ""
    left: int | None = None
    read_only = False
    written = 0


class _Budgeted:
    """A file opened for writing under the limited root: each write draws on the budget."""

    def __init__(self, fh):
        self._fh = fh

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data.encode())
        if _Disk.read_only:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), self._fh.name)
        if _Disk.left is not None and n > _Disk.left:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._fh.name)
        if _Disk.left is not None:
            _Disk.left -= n
        _Disk.written += n
        return self._fh.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def __iter__(self):
        return iter(self._fh)

    def __getattr__(self, name):
        return getattr(self._fh, name)


def _limit_disk(root: str, budget: int | None, read_only: bool) -> None:
    _Disk.root, _Disk.left, _Disk.read_only = root, budget, read_only
    real_open = builtins.open

    def limited_open(file, mode="r", *a, **k):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+"):
            path = os.path.realpath(os.fspath(file))
            if path.startswith(root):
                if read_only:
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(file))
                return _Budgeted(real_open(file, mode, *a, **k))
        return real_open(file, mode, *a, **k)

    builtins.open = limited_open
    io.open = limited_open
    if read_only:
        for name in ("mkdir", "makedirs", "replace", "rename", "link", "unlink", "remove", "rmdir"):
            _refuse_under_root(name, root)


def _refuse_under_root(name: str, root: str) -> None:
    real = getattr(os, name)

    def refused(path, *a, _real=real, **k):
        if os.path.realpath(os.fspath(path)).startswith(root):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
        return _real(path, *a, **k)

    setattr(os, name, refused)


# ---------------------------------------------------------------- what the tests tally


def tally_path() -> Path | None:
    """Where the reliability counts are appended (one JSON object per line), if anywhere."""
    value = os.environ.get("CACHEGRAFT_RELIABILITY_LOG")
    return Path(value) if value else None


def record(**counts) -> None:
    """Add counts to the session tally (printed at the end of the run; see conftest)."""
    from conftest import TALLY

    for key, value in counts.items():
        if key.startswith("max_"):
            TALLY[key] = max(TALLY.get(key, 0), value)
        else:
            TALLY[key] = TALLY.get(key, 0) + value
    path = tally_path()
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(counts) + "\n")
