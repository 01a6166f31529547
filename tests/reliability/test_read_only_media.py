"""Readers on read-only media, and a full disk during `index` on a real tiny filesystem.

A read-only store is served by `ask`, `store info` and `store verify`, and verify does not send the
user to `store repair` for a store that is only read-only. Tests run as root, where file modes
stop nothing: a real read-only bind mount is used where this machine lets the test make one
(skipped cleanly otherwise), and in every case an injected EROFS on every write call under the
store (tests/faults.py). Then `index` on a tmpfs with 4 to 48 KB free: a clean error or a
finished index, never exit 70, and the index that served before serves after.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from faults import Cli, Faults, record

READERS = (["store", "info", "{s}", "--json"], ["store", "verify", "{s}"],
           ["ask", "what of the harbor light 3?", "--store", "{s}", "-k", "1", "--max-new-tokens", "2", "--json"])


@pytest.fixture(scope="module")
def built(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("read_only")
    cli = Cli(root / "logs")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"note {i} on the harbor light"})
                              + "\n" for i in range(12)))
    store = root / "store"
    code, run = cli.run("encode", corpus, "--store", store, "--receiver", tiny_dirs["receiver"], "--dtype", "float32",
                        "--commit-every", 4)
    assert code == 0, run.stderr
    code, run = cli.run("index", "--store", store)
    assert code == 0, run.stderr
    return {"root": root, "cli": cli, "store": store}


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, check=False)


@pytest.fixture
def read_only_mount(built, tmp_path):
    """The store under a read-only bind mount, or a skip where mounting is refused."""
    src, view = tmp_path / "src", tmp_path / "view"
    shutil.copytree(built["store"], src)
    view.mkdir()
    done = _mount("--bind", str(src), str(view))
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({done.stderr.decode().strip() or done.returncode})")
    try:
        remount = _mount("-o", "remount,bind,ro", str(view))
        if remount.returncode != 0:
            pytest.skip(f"cannot remount read-only here ({remount.stderr.decode().strip()})")
        probe = view / "probe"
        with pytest.raises(OSError):
            probe.write_text("x")  # really read-only, for root too
        yield view
    finally:
        subprocess.run(["umount", "-l", str(view)], check=False)


def _readers_answer(cli: Cli, store: Path, faults: Faults | None) -> None:
    for args in READERS:
        code, run = cli.run(*[str(store) if a == "{s}" else a for a in args], faults=faults)
        assert code == 0, (args, run.stderr)
        assert "repair" not in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert len(json.loads(run.stdout)["passages"]) == 1


def test_readers_work_on_a_read_only_mount(built, read_only_mount):
    before = sorted(p.name for p in read_only_mount.rglob("*"))
    _readers_answer(built["cli"], read_only_mount, None)
    code, run = built["cli"].run("index", "--store", read_only_mount, "--rebuild")
    assert code == 14 and "not writable" in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert sorted(p.name for p in read_only_mount.rglob("*")) == before
    record(faults=4, erofs=4)


def test_readers_work_when_every_write_fails_with_erofs(built, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(built["store"], store)
    _readers_answer(built["cli"], store, Faults(disk_root=str(store), read_only=True))
    record(faults=3, erofs=3)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = _mount("-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path, free_kb: int) -> None:
    """Leave about `free_kb` KB free on the filesystem at `mount`."""
    filler = mount / "filler"
    filler.unlink(missing_ok=True)
    left = shutil.disk_usage(mount).free - free_kb * 1024
    with open(filler, "wb") as fh:
        fh.write(b"\0" * max(0, left))


@pytest.mark.parametrize("rebuild", [False, True])
def test_index_on_a_nearly_full_tmpfs_fails_cleanly_and_keeps_the_index(built, small_tmpfs, rebuild):
    cli = built["cli"]
    store = small_tmpfs / "store"
    shutil.copytree(built["store"], store)
    if not rebuild:
        shutil.rmtree(store / "index")
    results = []
    for free_kb in (4, 8, 16, 24, 32, 48):
        _fill(small_tmpfs, free_kb)
        made, run = cli.run("index", "--store", store, *(["--rebuild"] if rebuild else []))
        results.append((free_kb, made))
        assert made in (0, 14), (free_kb, run.stderr)
        assert "Traceback" not in run.stderr and "this is a bug" not in run.stderr, run.stderr
        if made == 14:
            assert "no space left" in run.stderr, run.stderr
        (small_tmpfs / "filler").unlink()
        if rebuild or made == 0:  # an index is there: it serves
            code, run = cli.run(*[str(store) if a == "{s}" else a for a in READERS[2]])
            assert code == 0 and len(json.loads(run.stdout)["passages"]) == 1, (free_kb, run.stderr)
        if not rebuild and made == 0:
            shutil.rmtree(store / "index")
    record(faults=len(results), enospc=sum(code == 14 for _, code in results))
