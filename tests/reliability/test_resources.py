"""Resources: a full disk (injected ENOSPC, and a real few-MB tmpfs where one can be mounted),
a read-only store, and memory while encoding a streamed 100k-passage input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from faults import Cli, Faults, record

from cachegraft_cli.store import CacheStore


def _corpus(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "title": f"T{i}", "text": f"note {i} on the harbor light"})
                            + "\n" for i in range(n)))
    return path


def _args(corpus, store, receiver) -> list:
    return ["encode", corpus, "--store", store, "--receiver", receiver, "--dtype", "float32", "--commit-every", 6]


@pytest.fixture(scope="module")
def clean_run(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("resources")
    cli = Cli(root / "logs")
    corpus = _corpus(root / "c.jsonl", 40)
    code, run = cli.run(*_args(corpus, root / "clean", tiny_dirs["receiver"]))
    assert code == 0, run.stderr
    clean = CacheStore.open(str(root / "clean"))
    size = sum(p.stat().st_size for p in (root / "clean").rglob("*") if p.is_file())
    return {"root": root, "cli": cli, "corpus": corpus, "size": size,
            "caches": dict(zip(clean.ids(), clean.read(clean.ids())))}


def _consistent(store: Path, caches: dict) -> int:
    opened = CacheStore.open(str(store))
    assert opened.verify()["ok"]
    assert sum(len(t) for t in opened.tables) == len(opened)
    for pid, got in zip(opened.ids(), opened.read(opened.ids())):
        assert np.array_equal(got, caches[pid])
    leftovers = [p for p in store.rglob("*") if ".tmp-" in p.name or p.name.endswith(".partial")]
    assert not leftovers, leftovers
    committed = {s["name"] for s in opened.segments}
    assert {p.name for p in (store / "segments").iterdir() if p.is_dir()} <= committed  # no half-written segment
    return len(opened)


def _one_error_line(stderr: str, text: str) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and text in errors[0] and "Traceback" not in stderr, stderr


def test_full_disk_during_encode_leaves_a_consistent_store_that_resumes(clean_run, tiny_dirs, tmp_path):
    cli, caches = clean_run["cli"], clean_run["caches"]
    store = tmp_path / "store"
    budget = clean_run["size"] // 2  # the disk fills half-way through
    code, run = cli.run(*_args(clean_run["corpus"], store, tiny_dirs["receiver"]),
                        faults=Faults(disk_root=str(tmp_path), disk_budget=budget))
    assert code == 14, run.stderr
    _one_error_line(run.stderr, "no space left on the device")
    held = _consistent(store, caches)
    assert 0 < held < 40
    elsewhere = tmp_path / "elsewhere"  # resumed on another disk ...
    shutil.copytree(store, elsewhere)
    code, run = cli.run(*_args(clean_run["corpus"], elsewhere, tiny_dirs["receiver"]))
    assert code == 0, run.stderr
    assert _consistent(elsewhere, caches) == 40
    code, run = cli.run(*_args(clean_run["corpus"], store, tiny_dirs["receiver"]))  # ... or once space is freed
    assert code == 0, run.stderr
    held, rows = len(CacheStore.open(str(store))), sum(len(t) for t in CacheStore.open(str(store)).tables)
    record(faults=1, enospc=1, lost=40 - held, duplicated=rows - held)
    assert _consistent(store, caches) == 40


@pytest.mark.parametrize("budget", [0, 3000])
def test_full_disk_during_store_creation(clean_run, tiny_dirs, tmp_path, budget):
    cli = clean_run["cli"]
    store = tmp_path / "store"
    code, run = cli.run(*_args(clean_run["corpus"], store, tiny_dirs["receiver"]),
                        faults=Faults(disk_root=str(store), disk_budget=budget))
    assert code == 14, run.stderr
    _one_error_line(run.stderr, "no space left")
    code, run = cli.run(*_args(clean_run["corpus"], store, tiny_dirs["receiver"]))
    assert code == 0, run.stderr
    assert _consistent(store, clean_run["caches"]) == 40
    record(faults=1, enospc=1)


def test_full_disk_during_index_rebuild_keeps_the_working_index(clean_run, tmp_path, capsys, monkeypatch):
    from cachegraft_cli.retrieval.stored import build_store_index, open_index

    cli = clean_run["cli"]
    store = tmp_path / "store"
    shutil.copytree(clean_run["root"] / "clean", store)
    build_store_index(str(store))
    before = [h.id for h in open_index(CacheStore.open(str(store)), str(store)).search("harbor light 7", 5)]
    for budget in (0, 2000):
        code, run = cli.run("index", "--store", store, "--rebuild",
                            faults=Faults(disk_root=str(store / "index"), disk_budget=budget))
        assert code == 14, run.stderr
        _one_error_line(run.stderr, "no space left")
        after = open_index(CacheStore.open(str(store)), str(store))
        assert [h.id for h in after.search("harbor light 7", 5)] == before
        assert len([p for p in (store / "index").iterdir() if p.name.startswith("v-")]) == 1  # staging removed
    record(faults=2, enospc=2)


def test_read_only_store_reads_and_refuses_writes_cleanly(clean_run, tmp_path):
    """info, verify and ask need no write access; index and encode say the store is read-only."""
    from cachegraft_cli.retrieval.stored import build_store_index

    cli = clean_run["cli"]
    store = tmp_path / "store"
    shutil.copytree(clean_run["root"] / "clean", store)
    build_store_index(str(store))
    ro = Faults(disk_root=str(store), read_only=True)
    for args in (["store", "info", store, "--json"], ["store", "verify", store],
                 ["ask", "harbor light 3", "--store", store, "--max-new-tokens", 2]):
        code, run = cli.run(*args, faults=ro)
        assert code == 0, run.stderr
    code, run = cli.run("index", "--store", store, "--rebuild", faults=ro)
    assert code == 14, run.stderr
    _one_error_line(run.stderr, "is not writable")
    code, run = cli.run("encode", _corpus(tmp_path / "more.jsonl", 3), "--store", store, "--receiver", "x", faults=ro)
    assert code != 70 and "Traceback" not in run.stderr, run.stderr
    record(faults=5, erofs=5)


# ---------------------------------------------------------------- a real small filesystem


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs, where this machine lets us mount one (root with the mount capability)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_tmpfs_during_encode(clean_run, tiny_dirs, tmpfs, tmp_path):
    cli = clean_run["cli"]
    big = _corpus(tmp_path / "big.jsonl", 200)  # ~4 MB of caches: more than the 1 MiB tmpfs holds
    store = tmpfs / "store"
    code, run = cli.run(*_args(big, store, tiny_dirs["receiver"]))
    assert code == 14, run.stderr
    _one_error_line(run.stderr, "no space left on the device")
    opened = CacheStore.open(str(store))
    assert opened.verify()["ok"] and 0 < len(opened) < 200
    moved = tmp_path / "moved"
    shutil.copytree(store, moved)
    code, run = cli.run(*_args(big, moved, tiny_dirs["receiver"]))
    assert code == 0, run.stderr
    final = CacheStore.open(str(moved))
    rows = sum(len(t) for t in final.tables)
    record(lost=200 - len(final), duplicated=rows - len(final))
    assert len(final) == 200 and final.verify()["ok"] and rows == 200
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)  # and now read-only, for real
    code, run = cli.run("store", "info", store, "--json")
    assert code == 0, run.stderr
    code, run = cli.run(*_args(big, store, tiny_dirs["receiver"]))
    assert code == 14 and "not writable" in run.stderr, run.stderr
    record(faults=2, enospc=1, erofs=1)


# ---------------------------------------------------------------- memory


def _rss_kb(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), None)
    return int(line.split()[1]) if line else None


def _segments(store: Path) -> int:
    try:
        return len(json.loads((store / "manifest.json").read_text())["segments"])
    except (OSError, ValueError, KeyError):
        return 0


def _encode_streamed(tmp_path: Path, receiver: Path, n: int, window: int) -> tuple[list[tuple[int, int]], float]:
    """Encode n passages generated into the child's stdin as it reads them (the input never
    exists as a whole, here either); (segments committed, RSS kB) sampled while it runs."""
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "cachegraft_cli", "encode", "-", "--store", str(store), "--receiver", str(receiver),
           "--dtype", "float32", "--codec", "int4", "--batch-size", "1024", "--commit-every", str(window),
           "--instruction", "A.", "--json"]
    start = time.perf_counter()
    log = tmp_path / "stderr"
    samples: list[tuple[int, int]] = []
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
        words = ["amber", "basalt", "cobalt", "dusk", "ember", "frost", "granite", "harbor"]

        def feed() -> None:
            for i in range(n):
                proc.stdin.write((json.dumps({"id": f"p{i}", "text": words[i % 8]}) + "\n").encode())
            proc.stdin.close()

        def watch() -> None:
            while proc.poll() is None:
                rss = _rss_kb(proc.pid)
                if rss:
                    samples.append((_segments(store), rss))
                time.sleep(0.1)

        threads = [threading.Thread(target=feed), threading.Thread(target=watch)]
        for t in threads:
            t.start()
        out = proc.stdout.read()
        proc.wait(timeout=1200)
        for t in threads:
            t.join()
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert json.loads(out)["added"] == n
    return samples, time.perf_counter() - start


def test_memory_stays_bounded_encoding_a_streamed_100k_passage_input(tiny_dirs, tmp_path):
    """RSS once 10k of 100k passages are committed, against the peak after that: what grows with
    the input. Streaming keeps only ids, hashes and row positions (a few hundred bytes a passage);
    the corpus held as a list of passages and their chunks, as encode did before, adds ~1.1 KB a
    passage more (337 B of passages + 786 B of chunks, tracemalloc, this input)."""
    from tiny import build_micro

    n, window = 100_000, 2_000
    receiver = build_micro(tmp_path / "micro", tokenizer_from=tiny_dirs["receiver"])
    samples, seconds = _encode_streamed(tmp_path, receiver, n, window)
    early = [rss for segs, rss in samples if segs >= 5]
    assert early, samples[-5:]
    grown = (max(early) - early[0]) * 1024 / (n - 5 * window)
    assert grown < 900, f"{grown:.0f} bytes a passage more: the input is held in memory"
    record(memory_bytes_per_passage=round(grown), memory_peak_mb_100k=round(max(early) / 1024),
           memory_seconds_100k=round(seconds))
    stored = CacheStore.open(str(tmp_path / "store"))
    assert len(stored) == n and sum(len(t) for t in stored.tables) == n and len(stored.segments) == n // window
