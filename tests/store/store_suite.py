"""The tests every cache-store URL kind passes (the `CacheStore` contract), like zarr's StoreTests.

A test module subclasses `StoreTests` and overrides the `url` fixture with a place where no store
exists yet (a local path, `file://`, `memory://`, `s3://` on the test's server); pytest collects
the inherited tests for it. No tests here: `test_store_urls.py` holds the subclasses.
"""

from __future__ import annotations

import numpy as np
import pytest
from store_support import (
    bf16_cache,
    decoded,
    files_under,
    fill,
    fingerprint,
    flip_bytes,
    identity,
    make,
    prefix,
    row,
    same_caches,
    shard_files,
)

from cachegraft_cli.errors import (
    StoreCorruptError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
    StoreNotFoundError,
    UsageError,
)
from cachegraft_cli.store import CacheStore, PassageRow


class StoreTests:
    @pytest.fixture
    def url(self):
        raise NotImplementedError("a subclass names where its stores live")

    # ---------------------------------------------------------------- create, open, missing

    def test_create_then_open_is_the_same_empty_store(self, url, rng):
        pre = prefix(rng)
        created = CacheStore.create(url, identity(), pre)
        opened = CacheStore.open(url)
        assert len(created) == len(opened) == 0 and opened.segments == [] and opened.ids() == []
        assert opened.identity == created.identity and opened.identity["codec"] == "bf16"
        assert np.array_equal(opened.prefix(), pre) and opened.kinds == created.kinds == ("fused",)
        assert CacheStore.check_exists(url)["identity"] == opened.identity

    def test_a_transform_codec_store_keeps_its_calibration_here(self, url, rng):
        from store_support import structured_cache, tc_calibration

        cal = tc_calibration()
        store = CacheStore.create(url, identity("tc"), prefix(rng), codec_params={"calibration": cal})
        caches = {f"p{i}": structured_cache(rng, 20 + i) for i in range(3)}
        with store.writer() as w:
            for pid, x in caches.items():
                w.add(row(0, id=pid, content_hash=pid), {"fused": x})
        again = CacheStore.open(url)
        assert again.meta["format_version"] == 4 and again.info()["codec_tables"]["sha256"] == cal.sha256
        for x, got in zip(caches.values(), again.read(list(caches))):
            assert np.sqrt(((got - x) ** 2).mean() / (x**2).mean()) < 0.12
        assert again.verify()["ok"]

    def test_create_existing_same_identity_opens_it(self, url, rng):
        fill(make(url, rng), rng, range(3))
        again = make(url, rng)
        assert len(again) == 3

    def test_mismatched_identity_names_key_and_both_sides(self, url, rng):
        make(url, rng)
        other = identity(receiver={"name": "tiny/receiver", "revision": "r2"})
        with pytest.raises(StoreMismatchError) as exc:
            CacheStore.create(url, other, prefix(rng))
        msg = str(exc.value)
        assert "receiver" in msg and '"r1"' in msg and '"r2"' in msg and "receiver.revision" in msg
        assert "--store" in exc.value.hint
        with pytest.raises(StoreMismatchError, match="codec"):
            CacheStore.open(url, expect={"codec": "int8", "dtype": "bfloat16"})
        with pytest.raises(StoreMismatchError, match="kinds"):
            make(url, rng, kinds=("fused", "own"))
        assert len(CacheStore.open(url, expect={"codec": "bf16", "geometry": identity()["geometry"]})) == 0

    def test_missing_store_and_bad_input(self, url, rng):
        with pytest.raises(StoreNotFoundError) as exc:
            CacheStore.open(url)
        assert "cachegraft encode" in exc.value.hint
        with pytest.raises(StoreNotFoundError):
            CacheStore.check_exists(url)
        with pytest.raises(UsageError, match="lacks"):
            CacheStore.create(url, {"codec": "bf16"}, prefix(rng))
        store = make(url, rng)
        with store.writer() as w, pytest.raises(UsageError, match="shape"):
            w.add(row(1), {"fused": np.zeros((4, 3, 2, 2, 9), np.float32)})
        with pytest.raises(StoreError, match="not in store"):
            store.read(["nope"])
        with pytest.raises(StoreError, match="'own'"):
            store.read([], kind="own")

    # ---------------------------------------------------------------- append, read

    def test_bf16_round_trip_is_bit_identical(self, url, rng):
        store = make(url, rng, kinds=("fused", "own"))
        data = fill(store, rng, range(30), kinds=("fused", "own"))
        again = CacheStore.open(url)
        ids = ["p7", "p0", "p29", "p7"]
        for kind in ("fused", "own"):
            for pid, got in zip(ids, again.read(ids, kind=kind)):
                assert got.dtype == np.float32
                assert np.array_equal(got.view(np.uint32), data[pid][kind].view(np.uint32))

    def test_each_writer_session_appends_one_segment(self, url, rng):
        store = make(url, rng)
        data = {}
        for ids in (range(4), range(4, 5), range(5, 12)):
            data.update(fill(store, rng, ids))
        again = CacheStore.open(url)
        assert [s["rows"] for s in again.segments] == [4, 1, 7] and sorted(again.ids()) == sorted(data)
        assert [again.segment_of(p) for p in ("p0", "p4", "p11")] == [s["name"] for s in again.segments]
        assert same_caches(again, {pid: d["fused"] for pid, d in data.items()})

    def test_snapshot_and_append_leave_old_chunks_untouched(self, url, rng):
        store = make(url, rng, shard_tokens=64)
        first = fill(store, rng, range(20))
        seg = store.segments[0]["name"]
        before = files_under(store, f"segments/{seg}")
        reader = CacheStore.open(url)
        second = fill(CacheStore.open(url), rng, range(20, 40))
        assert files_under(store, f"segments/{seg}") == before
        assert len(reader) == 20 and "p25" not in reader  # snapshot taken at open
        fresh = CacheStore.open(url)
        assert len(fresh) == 40 and [s["rows"] for s in fresh.segments] == [20, 20]
        both = {**first, **second}
        for pid, got in zip(["p3", "p33"], fresh.read(["p3", "p33"])):
            assert np.array_equal(got, both[pid]["fused"])
        assert store.has_hash("hash25") is False and fresh.has_hash("hash25")

    def test_later_segment_supersedes_an_id(self, url, rng):
        store = make(url, rng)
        fill(store, rng, range(3))
        new = bf16_cache(rng, 7)
        with store.writer() as w:
            w.add(row(1, text="edited", content_hash="hash1b"), {"fused": new})
        again = CacheStore.open(url)
        assert len(again) == 3 and again.get_rows(["p1"])[0].text == "edited"
        assert np.array_equal(again.read(["p1"])[0], new)

    def test_small_files_are_read_in_one_batch_in_request_order(self, url, rng):
        store = make(url, rng)
        fill(store, rng, range(2))
        fill(store, rng, range(2, 3))
        rels = [f"segments/{s['name']}/commit.json" for s in reversed(store.segments)] + ["manifest.json"]
        assert store.loc.read_many(rels) == [store.loc.read_bytes(r) for r in rels]
        assert store.loc.read_many([]) == []
        with pytest.raises(FileNotFoundError):
            store.loc.read_many(["segments/nowhere/commit.json"])

    def test_reads_touch_only_the_chunks_they_span(self, url, rng):
        store = make(url, rng, shard_tokens=1024, chunk_tokens=16)
        pool = bf16_cache(rng, 100)
        with store.writer() as w:
            for i in range(10_000):
                w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": pool[i % 50: i % 50 + 20 + i % 17]})
        reader = CacheStore.open(url)
        info = reader.info()
        chunks_per_shard = 1024 // 16
        ids = ["p17", "p5003", "p9998"]
        reader.read(ids)  # opens the array metadata
        reader.stats.reset()
        got = reader.read(ids)
        stored = sum(len(g) for g in got) * info["bytes_per_token"]["fused"]
        index = len(ids) * (16 * chunks_per_shard + 4)
        assert reader.stats.bytes <= 1.5 * stored + index
        rows = reader.get_rows(ids)
        shards = ({f"{r.offset // 1024}/0/0/0/0" for r in rows}
                  | {f"{(r.offset + r.tokens - 1) // 1024}/0/0/0/0" for r in rows})
        assert {k.split("/data/c/")[1] for k in reader.stats.keys} == shards

    # ---------------------------------------------------------------- rows and metadata

    def test_rows_keep_every_field_and_prefix(self, url, rng):
        pre = prefix(rng)
        store = CacheStore.create(url, identity(), pre)
        fill(store, rng, range(6))
        again = CacheStore.open(url)
        rows = {r.id: r for r in again.rows()}
        r = rows["p4"]
        assert (r.title, r.text, r.content_hash, r.metadata) == ("Title 4", "passage text 4", "hash4",
                                                                 {"n": 4, "tags": ["a", "b"]})
        assert (r.parent_id, r.chunk_index) == ("doc1", 1)
        assert r.tokens == len(again.read(["p4"])[0]) and r.segment == again.segments[0]["name"]
        assert again.get_rows(["p2"])[0] == rows["p2"]
        assert np.array_equal(again.prefix(), pre)
        assert again.prefix_token_ids == [1, 2, 3, 4]
        assert again.identity["receiver"] == {"name": "tiny/receiver", "revision": "r1"}
        assert again.has_hash("hash5") and not again.has_hash("hash6")
        assert again.content_hashes() == {f"p{i}": f"hash{i}" for i in range(6)}

    def test_info_reports_geometry_models_and_segments(self, url, rng):
        store = make(url, rng)
        fill(store, rng, range(4), lengths=(10, 11))
        fill(store, rng, range(4, 6), lengths=(10, 11))
        info = CacheStore.open(url).info()
        assert info["geometry"] == identity()["geometry"] and info["codec"] == "bf16"
        assert info["models"]["fuser"]["name"] == "tiny/fuser"
        assert (info["passages"], info["tokens"]) == (6, 60)
        assert [s["rows"] for s in info["segments"]["list"]] == [4, 2] and info["segments"]["count"] == 2
        assert info["bytes"]["total"] > 0 and info["bytes_per_token"]["fused"] > 0

    # ---------------------------------------------------------------- checksums, verify

    def test_verify_names_passage_and_segment_of_damage(self, url, rng):
        store = make(url, rng, shard_tokens=64)
        fill(store, rng, range(12), lengths=(10, 12))
        assert CacheStore.open(url).verify()["ok"]
        seg = store.segments[0]["name"]
        shard = shard_files(store, seg)[0]
        flip_bytes(store, shard, at=40)  # inside the first inner chunk
        report = CacheStore.open(url).verify()
        assert not report["ok"]
        problem = report["problems"][0]
        assert problem["segment"] == seg and problem["passage"] == "p0" and problem["kind"] == "fused"
        assert {p["passage"] for p in report["problems"]} <= {"p0", "p1"}

    def test_a_read_of_a_damaged_chunk_names_its_passage(self, url, rng):
        store = make(url, rng, shard_tokens=64)
        data = fill(store, rng, range(6), lengths=(10, 12))
        flip_bytes(store, shard_files(store, store.segments[0]["name"])[0], at=40)  # p0's chunk
        again = CacheStore.open(url)
        with pytest.raises(StoreCorruptError) as exc:
            again.read(["p5", "p0", "p4"])
        assert "'p0'" in str(exc.value) and "'p5'" not in str(exc.value) and store.segments[0]["name"] in str(exc.value)
        assert "store repair" in exc.value.hint
        assert np.array_equal(again.read(["p5"])[0], data["p5"]["fused"])  # a passage elsewhere still reads

    # ---------------------------------------------------------------- the lock

    def test_writer_is_exclusive(self, url, rng):
        store = make(url, rng)
        with store.writer({"who": "first"}):
            with pytest.raises(StoreLockedError) as exc:
                CacheStore.open(url).writer()
            assert "pid" in str(exc.value) and "store unlock" in exc.value.hint
        with store.writer() as w:  # released on exit
            w.add(row(1), {"fused": bf16_cache(rng, 3)})
        assert len(CacheStore.open(url)) == 1

    def test_the_lock_is_seen_while_held_and_gone_after(self, url, rng):
        from cachegraft_cli.store.lock import is_held, lock_store, unlock

        store = make(url, rng)
        assert not is_held(store.loc) and CacheStore.open(url).info()["writer"] is None
        with lock_store(url, {"who": "test"}) as lock:
            assert is_held(store.loc) and CacheStore.open(url).info()["writer"]["run"] == {"who": "test"}
            with pytest.raises(StoreLockedError):
                store.writer()
            with pytest.raises(StoreLockedError):
                unlock(store.loc)  # refused: the holder is this live process
            with store.writer(lock=lock) as w:  # a writer may run under a lock taken before
                w.add(row(0), {"fused": bf16_cache(rng, 3)})
        assert not is_held(store.loc) and unlock(store.loc) == "not locked"
        assert len(CacheStore.open(url)) == 1

    def test_failed_session_stays_invisible_and_is_collected(self, url, rng):
        store = make(url, rng, shard_tokens=64)
        fill(store, rng, range(5))
        with pytest.raises(RuntimeError):
            with store.writer() as w:
                for i in range(5, 40):
                    w.add(row(i), {"fused": bf16_cache(rng, 20)})  # flushes whole shards on the way
                raise RuntimeError("encoder crashed")
        again = CacheStore.open(url)
        assert len(again) == 5 and len(again.segments) == 1 and again.verify()["ok"]
        fill(again, rng, range(40, 42))
        assert len(CacheStore.open(url)) == 7
        assert len(set(again.loc.list_names("segments")) - {"zarr.json"}) == 2

    # ---------------------------------------------------------------- another writer, compaction

    def test_refresh_sees_another_writers_commit(self, url, rng):
        store = make(url, rng)
        first = fill(store, rng, range(3))
        reader = CacheStore.open(url)
        other = fill(CacheStore.open(url), rng, range(3, 5))  # another writer, its own handle
        assert len(reader) == 3 and "p4" not in reader
        assert reader.refresh() is reader
        assert len(reader) == 5 and [s["rows"] for s in reader.segments] == [3, 2]
        assert same_caches(reader, {pid: d["fused"] for pid, d in {**first, **other}.items()})
        assert reader.refresh().ids() == reader.ids()  # nothing new: nothing changes

    def test_compaction_merges_segments_without_changing_a_byte(self, url, rng):
        from cachegraft_cli.store.compact import CompactOptions, compact

        store = make(url, rng, shard_tokens=256)
        for s in range(4):
            fill(store, rng, range(s * 5, (s + 1) * 5), lengths=(5, 60))
        before = CacheStore.open(url)
        sums, caches = fingerprint(before), decoded(before)
        report = compact(url, CompactOptions(target_bytes=1 << 40))
        after = CacheStore.open(url)
        assert report["segments_before"] == 4 and report["segments_after"] == len(after.segments) == 1
        assert fingerprint(after) == sums and same_caches(after, caches) and after.verify()["ok"]
        assert same_caches(before, caches)  # a snapshot opened before still reads its retired segments
        assert before.refresh() is before and same_caches(before, caches)  # replaced segments: starts over
        fill(after, rng, range(20, 22))  # appends go on after the merged segment
        assert [s["rows"] for s in CacheStore.open(url).segments] == [20, 2]
