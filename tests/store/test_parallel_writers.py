"""Segments written by many workers and listed by one commit (no Ray needed here)."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import bf16_cache, identity, prefix, row

from cachegraft_cli.encoding.ray.ledger import SegmentLedger, SegmentReport
from cachegraft_cli.errors import StoreError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.parallel import SegmentWriter, commit_segments


def _report(seqs, name):
    return SegmentReport(list(seqs), {"name": name})


def test_ledger_lists_in_plan_order_and_never_twice():
    ledger = SegmentLedger(9)
    assert ledger.accept(_report([3, 4, 5], "b")) and ledger.ready() == []  # 0-2 not done: b waits
    assert ledger.accept(_report([6, 7, 8], "c")) and ledger.ready() == []
    assert not ledger.accept(_report([5, 4, 3], "b-again"))  # a second run of b's window is refused
    assert ledger.accept(_report([2, 0, 1], "a"))
    assert [r.entry["name"] for r in ledger.ready()] == ["a", "b", "c"] and ledger.complete
    assert ledger.duplicates == 1 and ledger.missing == 0 and ledger.ready() == []
    with pytest.raises(ValueError):
        SegmentLedger(3).accept(_report([2, 3], "outside"))


def test_workers_segments_are_invisible_until_listed_and_half_written_ones_never_are(tmp_path):
    rng = np.random.default_rng(0)
    store = CacheStore.create(str(tmp_path / "s"), identity(), prefix(rng))
    entries = []
    for w in range(2):  # two "workers", no lock between them
        with SegmentWriter(store, {"worker": w}) as writer:
            for i in range(3):
                writer.add(row(10 * w + i), {"fused": bf16_cache(rng, 7)})
            entries.append(writer.commit())
    assert len(CacheStore.open(store.loc.url)) == 0  # complete, but not listed
    with SegmentWriter(store) as half:
        half.add(row(99), {"fused": bf16_cache(rng, 7)})
        cut = half.commit()
    store.loc.remove(f"segments/{cut['name']}/commit.json")  # what a worker killed before its marker leaves
    with pytest.raises(StoreError, match="not complete"):
        commit_segments(store.loc, [entries[1], cut])
    assert len(CacheStore.open(store.loc.url)) == 0  # all or nothing
    commit_segments(store.loc, [entries[1], entries[0]])
    commit_segments(store.loc, [entries[0]])  # again: already listed, nothing changes
    listed = CacheStore.open(store.loc.url)
    assert [s["name"] for s in listed.segments] == [entries[1]["name"], entries[0]["name"]]
    assert sorted(listed.ids()) == ["p0", "p1", "p10", "p11", "p12", "p2"] and listed.verify()["ok"]


def test_recovery_deletes_a_workers_unlisted_segment_but_adopts_a_local_writers(tmp_path):
    """A worker's complete segment is committed only by its driver's listing; found unlisted by the next
    writer (its job is over) it is deleted, while a local writer's committed-but-unlisted one is adopted."""
    from cachegraft_cli.store import segments
    from cachegraft_cli.store.recover import recover

    rng = np.random.default_rng(1)
    store = CacheStore.create(str(tmp_path / "s"), identity(), prefix(rng))
    with store.writer() as writer:  # a local writer killed between its commit record and the manifest
        writer.add(row(2), {"fused": bf16_cache(rng, 7)})
        local = writer.commit()
    manifest = segments.load_manifest(store.loc)
    manifest["segments"] = [e for e in manifest["segments"] if e["name"] != local["name"]]
    store.loc.write_json_atomic("manifest.json", manifest)
    with SegmentWriter(store, {"worker": 0}) as writer:  # a worker of a job whose driver died before listing
        writer.add(row(1), {"fused": bf16_cache(rng, 7)})
        worker = writer.commit()
    assert worker["run_info"]["listed_by"] == "driver"
    fresh = CacheStore.open(store.loc.url)
    report = recover(fresh)
    assert report["adopted"] == [local["name"]] and report["retired"] == [worker["name"]]
    assert sorted(CacheStore.open(store.loc.url).ids()) == ["p2"]
    assert set(store.loc.list_names("segments")) - {"zarr.json"} == {local["name"]}
