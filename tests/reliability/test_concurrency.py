"""Two writers, killed writers, readers during an append."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import Cli, Faults, record

from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

HOLDER = r"""
import sys, time
from cachegraft_cli.store.lock import lock_store
from cachegraft_cli.store.target import Target
lock = lock_store(sys.argv[1], {"tool": "test holder"})
print("READY", flush=True)
time.sleep(120)
"""


def run(capsys, monkeypatch, *args):
    return run_cli(capsys, monkeypatch, *args)


def _corpus(path: Path, ids, text="note") -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": f"{text} {i} about harbor lights"}) + "\n" for i in ids))
    return path


@pytest.fixture
def holder(tmp_path):
    """A live process holding the writer lock of tmp_path/store."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "store")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "READY"
    yield proc
    proc.kill()
    proc.wait()


def test_second_writer_is_refused_at_once_in_one_line_naming_the_holder(holder, tiny_dirs, tmp_path, capsys,
                                                                        monkeypatch):
    from cachegraft_cli.lm import models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("models loaded before the lock"))
    corpus = _corpus(tmp_path / "c.jsonl", range(3))
    start = time.perf_counter()
    code, _, err = run(capsys, monkeypatch, "encode", corpus, "--store", tmp_path / "store", "--receiver",
                       tiny_dirs["receiver"])
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 6 and len(errors) == 1 and f"pid {holder.pid}" in errors[0], err
    assert time.perf_counter() - start < 10
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["writer.lock"]  # nothing else written
    code, _, err = run(capsys, monkeypatch, "store", "repair", tmp_path / "store")
    assert code == 6 and f"pid {holder.pid}" in err  # repair is a writer too
    record(faults=1, concurrency=1)


def test_a_killed_writer_leaves_a_lock_the_next_writer_takes_over(tiny_dirs, tmp_path, capsys, monkeypatch):
    cli = Cli(tmp_path / "logs")
    corpus = _corpus(tmp_path / "c.jsonl", range(60))
    store = tmp_path / "store"
    args = ["encode", corpus, "--store", store, "--receiver", tiny_dirs["receiver"], "--dtype", "float32",
            "--commit-every", 5]
    first = cli.start(*args, faults=Faults(kill_at=40))  # dies inside its writes, holding the lock
    assert first.wait() == -9
    code, out, _ = run(capsys, monkeypatch, "store", "unlock", store)
    assert code == 0 and "not locked" in out  # the OS dropped the lock with the process
    code, out, err = run(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    store_now = CacheStore.open(str(store))
    rows = sum(len(t) for t in store_now.tables)
    record(kills=1, faults=1, lost=60 - len(store_now), duplicated=rows - len(store_now))
    assert len(store_now) == 60 and store_now.verify()["ok"] and rows == 60


def test_a_writer_plans_against_the_manifest_it_reads_after_the_lock(tiny_dirs, tmp_path):
    """B holds a view from before A's append; B's encode must see A's rows (no duplicates) and
    refuse a changed text for one of them, as if it had read the store after A."""
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.errors import CorpusError
    from cachegraft_cli.session import ModelChoice, ModelSession

    url = str(tmp_path / "store")
    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    encode_corpus(read_corpus(_corpus(tmp_path / "a.jsonl", range(4))), Target.open(url), session, EncodeOptions())
    stale = CacheStore.open(url)  # B's view
    cli = Cli(tmp_path / "logs")
    code, run_a = cli.run("encode", _corpus(tmp_path / "b.jsonl", range(4, 10)), "--store", url, "--receiver",
                          tiny_dirs["receiver"], "--dtype", "float32")  # writer A appends p4..p9
    assert code == 0, run_a.stderr
    assert len(stale) == 4
    summary = encode_corpus(read_corpus(_corpus(tmp_path / "c.jsonl", range(12))), Target.open(url),
                                                                            session, EncodeOptions())
    assert (summary.added, summary.skipped_existing) == (2, 10)
    with pytest.raises(CorpusError, match="'p5' is already in the store with different text"):
        encode_corpus(read_corpus(_corpus(tmp_path / "d.jsonl", [5], text="changed")), Target.open(url),
                                          session, EncodeOptions())
    with stale.writer({"test": "late writer"}):  # a writer brings its snapshot up to date under the lock
        assert len(stale) == 12
    fresh = CacheStore.open(url)
    record(faults=1, concurrency=1, duplicated=sum(len(t) for t in fresh.tables) - len(fresh))
    assert len(fresh) == 12 and sum(len(t) for t in fresh.tables) == 12 and fresh.verify()["ok"]


def test_readers_see_the_last_committed_state_during_an_append(tiny_dirs, tmp_path, capsys, monkeypatch):
    from cachegraft_cli.retrieval.stored import build_store_index

    cli = Cli(tmp_path / "logs")
    store = tmp_path / "store"
    base = ["--store", store, "--receiver", tiny_dirs["receiver"], "--dtype", "float32", "--commit-every", 4]
    code, first = cli.run("encode", _corpus(tmp_path / "a.jsonl", range(8)), *base)
    assert code == 0, first.stderr
    build_store_index(str(store))
    reader = CacheStore.open(str(store))
    before = dict(zip(reader.ids(), reader.read(reader.ids())))
    append = cli.start("encode", _corpus(tmp_path / "b.jsonl", range(8, 200)), *base)
    deadline = time.time() + 120
    while len(CacheStore.open(str(store))) == 8 and time.time() < deadline:  # wait for the first new segment
        time.sleep(0.05)
    code, out, err = run(capsys, monkeypatch, "ask", "harbor lights 3", "--store", store, "--json",
                         "--max-new-tokens", 2)
    assert code == 0, err
    assert "warning: the index of" in err and "covers 8 of its" in err  # answers from what the index covers
    assert json.loads(out)["passages"]
    assert append.wait() == 0, append.stderr
    assert sorted(reader.ids()) == sorted(before)  # the snapshot taken at open is unchanged
    for pid, got in zip(reader.ids(), reader.read(reader.ids())):
        assert np.array_equal(got, before[pid])
    assert len(CacheStore.open(str(store))) == 200
    record(faults=1, concurrency=1)
