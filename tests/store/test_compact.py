"""`store compact`: merged segments hold the same cache bytes (checksums equal), readers stay
consistent during and after it, and a SIGKILL at any point leaves a good store."""

from __future__ import annotations

import json
import signal
import sys
import threading

import numpy as np
import pytest
from faults import Cli, Faults
from store_support import bf16_cache, decoded, fill, fingerprint, identity, prefix, row, same_caches

from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.compact import CompactOptions, compact, plan_groups


def _store(url: str, codec: str = "bf16", segments: int = 6, per: int = 7, seed: int = 0):
    """A store of `segments` small segments (p0 in the first and again, changed, in the last)."""
    rng = np.random.default_rng(seed)
    store = CacheStore.create(url, identity(codec), prefix(rng), shard_tokens=256)
    data = {}
    for s in range(segments):
        data.update(fill(store, rng, range(s * per, (s + 1) * per), lengths=(5, 60)))
    with store.writer() as w:  # p0 written again: the later row must keep winning after compaction
        data["p0"] = {"fused": bf16_cache(rng, 9)}
        w.add(row(0, text="changed", content_hash="hash0-changed"), data["p0"])
    return data


@pytest.mark.parametrize("codec", ["bf16", "int4"])
def test_compaction_keeps_every_cache_byte(tmp_path, codec):
    url = str(tmp_path / "s")
    data = _store(url, codec)
    before = CacheStore.open(url)
    sums, caches = fingerprint(before), decoded(before)
    report = compact(url, CompactOptions(target_bytes=1 << 40))
    after = CacheStore.open(url)
    assert report["segments_before"] == 7 and report["segments_after"] == len(after.segments) == 1
    assert fingerprint(after) == sums  # checksums, hashes and token counts of every row
    assert same_caches(after, caches) and after.verify()["ok"] and after.get_rows(["p0"])[0].text == "changed"
    if codec == "bf16":
        assert same_caches(after, {i: d["fused"] for i, d in data.items()}) and "token_extent" not in after.segments[0]
    else:  # int4 key groups: sources start on 128-token boundaries, the gaps belong to no passage
        assert after.segments[0]["token_extent"] > after.segments[0]["tokens"] == before.info()["tokens"]


def test_only_runs_of_small_segments_merge(tmp_path):
    entries = [{"name": n, "bytes": {"fused": b}} for n, b in zip("abcdefgh", [10, 10, 50, 10, 10, 10, 10, 10])]
    groups = [[e["name"] for e in g] for g in plan_groups(entries, 30)]
    assert groups == [["a", "b"], ["d", "e", "f"], ["g", "h"]]  # c is not small (half the target or more)
    assert plan_groups(entries[1:4], 30) == []  # runs of one are left alone
    url = str(tmp_path / "s")
    _store(url, segments=7)
    entries = CacheStore.open(url).segments
    target = 2 * max(sum(e["bytes"].values()) for e in entries) + 1  # every segment small, runs of 3 or more
    want = [[e["name"] for e in g] for g in plan_groups(entries, target)]
    report = compact(url, CompactOptions(target_bytes=target))
    assert [m["from"] for m in report["merged"]] == want and len(want) >= 2
    assert compact(url, CompactOptions(target_bytes=target))["merged"] == []  # nothing left to do
    assert CacheStore.open(url).verify()["ok"]


def test_readers_see_a_consistent_store_during_and_after(tmp_path):
    url = str(tmp_path / "s")
    _store(url, segments=8)
    old = CacheStore.open(url)
    data = decoded(old)  # a snapshot taken before: its segments are retired, not deleted
    seen, stop, errors = [], threading.Event(), []

    def reader():
        while not stop.is_set():
            try:
                store = CacheStore.open(url)
                seen.append((len(store.segments), same_caches(store, data)))
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        compact(url, CompactOptions(target_bytes=1 << 40))
    finally:
        stop.set()
        thread.join()
    assert not errors and seen and all(ok for _, ok in seen)
    assert {n for n, _ in seen} <= {9, 1}  # the old manifest or the new one, nothing in between
    assert same_caches(old, data)  # still reads its (retired) segments
    assert same_caches(CacheStore.open(url), data) and len(CacheStore.open(url).segments) == 1
    fill(CacheStore.open(url), np.random.default_rng(5), range(100, 102))  # a writer's garbage collection keeps them
    assert same_caches(old, data)
    report = compact(url, CompactOptions(target_bytes=1 << 40, grace_seconds=0))
    assert {s["name"] for s in old.segments} < set(report["retired_deleted"])  # and the two just merged
    names = set(CacheStore.open(url).loc.list_names("segments")) - {"zarr.json"}
    assert names == {s["name"] for s in CacheStore.open(url).segments}


def test_compact_cli(tmp_path, capsys, monkeypatch):
    from cachegraft_cli.cli.app import main

    url = str(tmp_path / "s")
    _store(url, segments=3)
    monkeypatch.setattr(sys, "argv", ["cachegraft", "store", "compact", url, "--json"])
    with pytest.raises(SystemExit) as info:
        main()
    report = json.loads(capsys.readouterr().out)
    assert info.value.code in (0, None) and report["segments_after"] == 1 and len(report["merged"][0]["from"]) == 4


# A compaction that kills itself just before the named step (or stalls mid-copy for the parent to kill).
MODES = {"mid-copy": Faults(stall_before="write_bytes:*/c/*"),
         "before-commit-marker": Faults(kill_before="write_json:*commit.json"),
         "before-manifest-1": Faults(kill_before="write_json:manifest.json#1"),
         "before-manifest-2": Faults(kill_before="write_json:manifest.json#2"),
         "mid-purge": Faults(kill_before="remove:segments/*")}


@pytest.mark.parametrize("mode", ["mid-copy", "before-commit-marker", "before-manifest-1", "before-manifest-2",
                                  "mid-purge"])
def test_sigkill_at_any_point_of_compaction(tmp_path, mode):
    url = str(tmp_path / "s")
    _store(url, "int4", segments=6)
    sums, data = fingerprint(CacheStore.open(url)), decoded(CacheStore.open(url))
    sizes = [sum(e["bytes"].values()) for e in CacheStore.open(url).segments]
    target, grace = max(sizes) * 2 + 1, 3600.0  # several groups: the kill can fall between two swaps
    if mode == "mid-purge":
        compact(url, CompactOptions(target_bytes=target))  # retire some, then purge them in the child
        target, grace = 1 << 40, 0.0
    proc = Cli(tmp_path / "logs").call(compact, url, CompactOptions(target_bytes=target, grace_seconds=grace),
                                       faults=MODES[mode])
    if mode == "mid-copy":
        proc.wait_for("STALLED")
        proc.kill()
    assert proc.wait(timeout=120) == -signal.SIGKILL
    store = CacheStore.open(url)
    assert fingerprint(store) == sums and same_caches(store, data) and store.verify()["ok"]
    compact(url, CompactOptions(target_bytes=1 << 40, grace_seconds=0))  # finishes the job, deletes the garbage
    final = CacheStore.open(url)
    assert fingerprint(final) == sums and same_caches(final, data) and final.verify()["ok"]
    assert len(final.segments) == 1
    names = set(final.loc.list_names("segments")) - {"zarr.json"}
    assert names == {final.segments[0]["name"]}


def test_repair_of_a_lost_manifest_after_compaction_lists_the_merge_and_retires_its_sources(tmp_path):
    """Rebuilt from commit records, a compacted store lists the merged segment once (not its sources
    too: every row would be there twice) and keeps the sources as retired for the grace period."""
    from cachegraft_cli.store.repair import repair

    url = str(tmp_path / "s")
    data = _store(url, segments=3)
    sums = fingerprint(CacheStore.open(url))
    report = compact(url, CompactOptions(target_bytes=1 << 40))
    sources = report["merged"][0]["from"]
    (tmp_path / "s" / "manifest.json").unlink()
    fixed = repair(url)
    assert fixed.manifest == "rebuilt from 1 commit records" and fixed.ok, fixed.problems_left
    store = CacheStore.open(url)
    assert fingerprint(store) == sums and same_caches(store, {k: v["fused"] for k, v in data.items()})
    assert sorted(r["name"] for r in segments_manifest(store)["retired"]) == sorted(sources)
    fill(store, np.random.default_rng(9), range(200, 201))  # a writer's recovery keeps the retired sources
    assert {n for n in sources if (tmp_path / "s" / "segments" / n).exists()} == set(sources)


def segments_manifest(store) -> dict:
    from cachegraft_cli.store import segments

    return segments.load_manifest(store.loc)
