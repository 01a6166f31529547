"""Repair, undo and compact are journaled: a SIGKILL at every mutation point loses no readable
passage, `store repair --undo` after any of them puts the store back byte for byte (index too),
and undo deletes nothing its journal does not list. Plus: a rebuilt manifest keeps commit order
exactly, even when the clock says otherwise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import Cli, Faults, record
from store_support import bf16_cache, fill, flip_bytes, identity, indexed_store, prefix, row, shard_files

from cachegraft_cli.errors import StoreError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.compact import CompactOptions, compact
from cachegraft_cli.store.repair import repair, undo

WORDS = ["amber", "basalt", "cobalt", "dusk", "ember", "frost", "granite", "harbor", "indigo", "jade", "kelp", "lumen"]


@pytest.fixture(scope="module")
def damaged(tiny_dirs, tmp_path_factory):
    """12 indexed passages in 4 segments; one chunk of segment 1 flipped (its rows fail their crc),
    segment 2's commit record deleted: a repair moves, copies, writes records and rebuilds the index."""
    root = tmp_path_factory.mktemp("journal")
    built = indexed_store(root, WORDS, tiny_dirs["receiver"], commit_every=3)
    store = CacheStore.open(str(built["store"]))
    names = [s["name"] for s in store.segments]
    flip_bytes(store, shard_files(store, names[1])[0], at=40)
    (built["store"] / "segments" / names[2] / "commit.json").unlink()
    lost = {pid for pid in CacheStore.open(str(built["store"])).tables[1].ids}
    readable = {k: v for k, v in built["caches"].items() if k not in lost}
    return {"store": built["store"], "readable": readable, "lost": lost, "files": _files(built["store"])}


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a store but its locks, by path: what undo must restore byte for byte (index included)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("writer.lock", "lock")}


def _steps(cli: Cli, store: Path, tmp: Path, *args) -> int:
    steps = tmp / "steps"
    code, run = cli.run(*args, faults=Faults(steps_file=str(steps)))
    assert code == 0, run.stderr
    return int(steps.read_text())


def _holds_the_readable(store: Path, readable: dict) -> None:
    opened = CacheStore.open(str(store))
    assert set(readable) <= set(opened.ids())
    assert all(np.array_equal(a, readable[k]) for k, a in zip(readable, opened.read(list(readable))))


def _repair_ids(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "quarantine").iterdir()) if (store / "quarantine").exists() else []


def test_a_kill_at_every_step_of_repair_then_undo_or_repair_again_loses_nothing(damaged, tmp_path, capsys,
                                                                                  monkeypatch):
    """Case 1: a repair killed between moving a segment aside and journaling it lost 5 of 24 passages
    to the undo. Now each step is journaled before it is taken: after a kill at any step, undo puts
    the store back byte for byte (no temp file, no work folder left), and a second repair holds every
    passage the damage left readable."""
    cli = Cli(tmp_path / "logs")
    reference = tmp_path / "reference"
    shutil.copytree(damaged["store"], reference)
    total = _steps(cli, reference, tmp_path, "store", "repair", reference)
    kills = 0
    for step in range(1, total + 1):
        store = tmp_path / f"s{step}"
        shutil.copytree(damaged["store"], store)
        code, run = cli.run("store", "repair", store, faults=Faults(kill_at=step))
        assert code == -9, (step, run.stderr[-2000:])
        kills += 1
        again = tmp_path / f"again{step}"
        shutil.copytree(store, again)
        for repair_id in _repair_ids(store):  # undo what the killed repair did
            code, _, err = run_cli(capsys, monkeypatch, "store", "repair", store, "--undo", repair_id)
            assert code == 0, (step, err)
        assert _files(store) == damaged["files"], step
        code, _, err = run_cli(capsys, monkeypatch, "store", "repair", again)
        assert code == 0, (step, err)
        _holds_the_readable(again, damaged["readable"])
        shutil.rmtree(store)
        shutil.rmtree(again)
    assert kills == total >= 10
    print(f"repair: {total} kill points, each undone and repaired again")
    record(kills=kills, lost=0)


def test_a_kill_at_every_step_of_undo_then_undo_again_restores_the_store(damaged, tmp_path, capsys, monkeypatch):
    cli = Cli(tmp_path / "logs")
    repaired = tmp_path / "repaired"
    shutil.copytree(damaged["store"], repaired)
    code, _, err = run_cli(capsys, monkeypatch, "store", "repair", repaired)
    assert code == 0, err
    (repair_id,) = _repair_ids(repaired)
    reference = tmp_path / "reference"
    shutil.copytree(repaired, reference)
    total = _steps(cli, reference, tmp_path, "store", "repair", reference, "--undo", repair_id)
    for step in range(1, total + 1):
        store = tmp_path / f"s{step}"
        shutil.copytree(repaired, store)
        code, run = cli.run("store", "repair", store, "--undo", repair_id, faults=Faults(kill_at=step))
        assert code == -9, (step, run.stderr[-2000:])
        if _repair_ids(store):
            code, _, err = run_cli(capsys, monkeypatch, "store", "repair", store, "--undo", repair_id)
            assert code == 0, (step, err)
        assert _files(store) == damaged["files"], step
        shutil.rmtree(store)
    print(f"undo: {total} kill points")
    record(kills=total, lost=0)


def test_a_kill_at_every_step_of_compaction_loses_nothing(tmp_path):
    rng = np.random.default_rng(4)
    url = tmp_path / "s"
    store = CacheStore.create(str(url), identity("int8"), prefix(rng), shard_tokens=64)
    for s in range(4):
        fill(store, rng, range(s * 3, s * 3 + 3), lengths=(5, 40))
    opened = CacheStore.open(str(url))
    caches = dict(zip(opened.ids(), opened.read(opened.ids())))
    cli = Cli(tmp_path / "logs")
    steps = 0
    options = CompactOptions(target_bytes=1 << 40, grace_seconds=0)
    for step in range(1, 200):
        trial = tmp_path / f"t{step}"
        shutil.copytree(url, trial)
        proc = cli.call(compact, str(trial), options, faults=Faults(kill_at=step))
        finished = proc.wait(timeout=120) == 0
        got = CacheStore.open(str(trial))
        assert got.verify()["ok"] and all(np.array_equal(a, caches[k]) for k, a in zip(got.ids(), got.read(got.ids())))
        assert sorted(got.ids()) == sorted(caches)
        shutil.rmtree(trial)
        if finished:
            break
        steps += 1
    assert 5 < steps < 199  # every step of one whole compaction was a kill point
    print(f"compaction: {steps} kill points")
    record(kills=steps, lost=0)


# ---------------------------------------------------------------- undo deletes only what it lists


def test_undo_keeps_a_quarantine_that_holds_what_its_journal_does_not_list(tmp_path):
    rng = np.random.default_rng(2)
    url = tmp_path / "s"
    store = CacheStore.create(str(url), identity("int8"), prefix(rng))
    fill(store, rng, range(3))
    fill(store, rng, range(3, 6))
    names = [s["name"] for s in CacheStore.open(str(url)).segments]
    flip_bytes(store, shard_files(store, names[0])[0], at=40)
    report = repair(str(url))
    repair_id = report.undo.rsplit(" ", 1)[-1]
    stray = url / "quarantine" / repair_id / "segments" / "20200101T000000-elsewhere-1-abcdef"
    stray.mkdir()
    (stray / "commit.json").write_text("{}")
    with pytest.raises(StoreError, match="does not list"):
        undo(str(url), repair_id)
    assert (stray / "commit.json").exists()
    assert sorted(CacheStore.open(str(url)).ids()) == [f"p{i}" for i in range(6)]  # the store itself is back


def test_undo_is_byte_identical_under_index(damaged, tmp_path, capsys, monkeypatch):
    """Case 12: the repair rebuilt the index and undo rebuilt it again (new version names, other bytes)."""
    store = tmp_path / "s"
    shutil.copytree(damaged["store"], store)
    code, out, err = run_cli(capsys, monkeypatch, "store", "repair", store, "--json")
    result = json.loads(out)
    assert code == 0 and "rebuilt" in (result["index"] or ""), err
    code, _, err = run_cli(capsys, monkeypatch, *result["undo"].split()[1:])
    assert code == 0, err
    index = {k: v for k, v in _files(store).items() if k.startswith("index/")}
    assert index and index == {k: v for k, v in damaged["files"].items() if k.startswith("index/")}


# ---------------------------------------------------------------- commit order


def test_a_rebuilt_manifest_keeps_a_replacement_after_what_it_replaced_whatever_the_clock_says(tmp_path):
    """Case 3: segments committed in the same second were ordered by their random names, and a
    passage replaced through the library went back to its old text after `repair`."""
    rng = np.random.default_rng(6)
    url = tmp_path / "s"
    store = CacheStore.create(str(url), identity("int8"), prefix(rng))
    fill(store, rng, range(3))
    with store.writer() as w:
        w.add(row(1, text="the new text", content_hash="new"), {"fused": bf16_cache(rng, 6)})
    first, second = [s["name"] for s in CacheStore.open(str(url)).segments]
    for name, stamp in ((first, "2026-12-03T10:00:00+00:00"), (second, "2026-12-03T09:59:59+00:00")):
        path = url / "segments" / name / "commit.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "committed": stamp}))  # a clock that jumped
    (url / "manifest.json").unlink()
    assert repair(str(url)).ok
    (got,) = CacheStore.open(str(url)).get_rows(["p1"])
    assert got.text == "the new text" and got.segment == second
