"""The store suite: every test runs on a local directory and on fsspec memory://."""

from __future__ import annotations

import numpy as np
import pytest

from cachegraft_cli.errors import StoreError, StoreLockedError, StoreMismatchError, StoreNotFoundError, UsageError
from cachegraft_cli.store import CacheStore, PassageRow
from test_store_support import bf16_cache, fill, files_under, flip_bytes, identity, memory_url, prefix, row, shard_files


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    return str(tmp_path / "store") if request.param == "local" else memory_url()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def make(url, rng, codec="bf16", kinds=("fused",), **kw):
    return CacheStore.create(url, identity(codec), prefix(rng), kinds=kinds, **kw)


def test_bf16_round_trip_is_bit_identical(url, rng):
    store = make(url, rng, kinds=("fused", "own"))
    data = fill(store, rng, range(30), kinds=("fused", "own"))
    again = CacheStore.open(url)
    ids = ["p7", "p0", "p29", "p7"]
    for kind in ("fused", "own"):
        for pid, got in zip(ids, again.read(ids, kind=kind)):
            assert got.dtype == np.float32
            assert np.array_equal(got.view(np.uint32), data[pid][kind].view(np.uint32))


def test_rows_keep_every_field_and_prefix(url, rng):
    pre = prefix(rng)
    store = CacheStore.create(url, identity(), pre)
    fill(store, rng, range(6))
    again = CacheStore.open(url)
    rows = {r.id: r for r in again.rows()}
    r = rows["p4"]
    assert (r.title, r.text, r.content_hash, r.metadata) == ("Title 4", "passage text 4", "hash4", {"n": 4, "tags": ["a", "b"]})
    assert (r.parent_id, r.chunk_index) == ("doc1", 1)
    assert r.tokens == len(again.read(["p4"])[0]) and r.segment == again.segments[0]["name"]
    assert again.get_rows(["p2"])[0] == rows["p2"]
    assert np.array_equal(again.prefix(), pre)
    assert again.prefix_token_ids == [1, 2, 3, 4]
    assert again.identity["receiver"] == {"name": "tiny/receiver", "revision": "r1"}
    assert again.has_hash("hash5") and not again.has_hash("hash6")


def _int4_key_bound(data: dict, rows: list) -> dict:
    """Keys share one scale per channel per 32-token group of the segment: bound = group maxabs / 7 / 2."""
    keys = np.concatenate([data[r.id]["fused"][:, :, 0] for r in sorted(rows, key=lambda r: r.offset)])
    groups = -(-len(keys) // 32)
    padded = np.zeros((groups * 32,) + keys.shape[1:], np.float32)
    padded[: len(keys)] = np.abs(keys)
    gmax = np.repeat(padded.reshape((groups, 32) + keys.shape[1:]).max(axis=1), 32, axis=0)
    return {r.id: gmax[r.offset: r.offset + r.tokens] / 7 / 2 for r in rows}


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_quantised_codecs_stay_within_their_error_bound(url, rng, codec):
    store = make(url, rng, codec=codec)
    data = fill(store, rng, range(12), lengths=(30, 90))
    again = CacheStore.open(url)
    slack = 1 + 2**-9  # float16 scales are rounded up by at most one ulp
    key_bound = _int4_key_bound(data, again.rows()) if codec == "int4" else None
    for pid, got in zip(data, again.read(list(data))):
        x = data[pid]["fused"]
        err = np.abs(got - x)
        if codec == "int8":  # one scale per (token, layer, K/V, head): |error| <= (maxabs / 127) / 2
            assert (err <= np.abs(x).max(axis=-1, keepdims=True) / 127 / 2 * slack + 1e-7).all()
        else:  # values: one scale per token and head (head_dim 8 < group 64): |error| <= (maxabs / 7) / 2
            assert (err[:, :, 0] <= key_bound[pid] * slack + 1e-7).all()
            assert (err[:, :, 1] <= np.abs(x[:, :, 1]).max(axis=-1, keepdims=True) / 7 / 2 * slack + 1e-7).all()
        rel = np.linalg.norm(got - x) / np.linalg.norm(x)
        assert rel < (0.01 if codec == "int8" else 0.15)


def test_create_existing_same_identity_opens_it(url, rng):
    fill(make(url, rng), rng, range(3))
    again = make(url, rng)
    assert len(again) == 3


def test_mismatched_identity_names_key_and_both_sides(url, rng):
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


def test_missing_store_and_bad_input(url, rng):
    with pytest.raises(StoreNotFoundError) as exc:
        CacheStore.open(url)
    assert "cachegraft encode" in exc.value.hint
    with pytest.raises(UsageError, match="lacks"):
        CacheStore.create(url, {"codec": "bf16"}, prefix(rng))
    store = make(url, rng)
    with store.writer() as w, pytest.raises(UsageError, match="shape"):
        w.add(row(1), {"fused": np.zeros((4, 3, 2, 2, 9), np.float32)})
    with pytest.raises(StoreError, match="not in store"):
        store.read(["nope"])
    with pytest.raises(StoreError, match="'own'"):
        store.read([], kind="own")


def test_writer_is_exclusive(url, rng):
    store = make(url, rng)
    with store.writer({"who": "first"}):
        with pytest.raises(StoreLockedError) as exc:
            CacheStore.open(url).writer()
        assert "pid" in str(exc.value) and "store unlock" in exc.value.hint
    with store.writer() as w:  # released on exit
        w.add(row(1), {"fused": bf16_cache(rng, 3)})
    assert len(CacheStore.open(url)) == 1


def test_failed_session_stays_invisible_and_is_collected(url, rng):
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


def test_snapshot_and_append_leave_old_chunks_untouched(url, rng):
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


def test_later_segment_supersedes_an_id(url, rng):
    store = make(url, rng)
    fill(store, rng, range(3))
    new = bf16_cache(rng, 7)
    with store.writer() as w:
        w.add(row(1, text="edited", content_hash="hash1b"), {"fused": new})
    again = CacheStore.open(url)
    assert len(again) == 3 and again.get_rows(["p1"])[0].text == "edited"
    assert np.array_equal(again.read(["p1"])[0], new)


def test_reads_touch_only_the_chunks_they_span(url, rng):
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
    shards = {f"{r.offset // 1024}/0/0/0/0" for r in rows} | {f"{(r.offset + r.tokens - 1) // 1024}/0/0/0/0" for r in rows}
    assert {k.split("/data/c/")[1] for k in reader.stats.keys} == shards


def test_verify_names_passage_and_segment_of_damage(url, rng):
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


def test_info_reports_geometry_models_and_segments(url, rng):
    store = make(url, rng)
    fill(store, rng, range(4), lengths=(10, 11))
    fill(store, rng, range(4, 6), lengths=(10, 11))
    info = CacheStore.open(url).info()
    assert info["geometry"] == identity()["geometry"] and info["codec"] == "bf16"
    assert info["models"]["fuser"]["name"] == "tiny/fuser"
    assert (info["passages"], info["tokens"]) == (6, 60)
    assert [s["rows"] for s in info["segments"]["list"]] == [4, 2] and info["segments"]["count"] == 2
    assert info["bytes"]["total"] > 0 and info["bytes_per_token"]["fused"] > 0


def test_content_hashes_come_from_the_index_tables(tmp_path):
    from cachegraft_cli.store import CacheStore, PassageRow

    geometry = {"layers": 1, "kv_heads": 1, "head_dim": 4}
    identity = {"receiver": None, "sharer": None, "fuser": None, "template": {}, "prefix_token_ids": [1],
                "position_scheme": "canonical", "dtype": "float32", "codec": "float32", "geometry": geometry}
    store = CacheStore.create(str(tmp_path / "s"), identity, np.zeros((1, 1, 2, 1, 4), np.float32))
    with store.writer() as w:
        w.add(PassageRow("a", text="x", content_hash="h1"), {"fused": np.ones((2, 1, 2, 1, 4), np.float32)})
    reopened = CacheStore.open(str(tmp_path / "s"))
    assert reopened.content_hashes() == {"a": "h1"}
    assert all(t.content is None for t in reopened._tables)  # no text was loaded


def _as_format_1(url):
    """Mark a new, empty store as format 1, whose segments keep JSON row tables (stores made before rows.bin)."""
    from cachegraft_cli.store.layout import ROOT_META
    from cachegraft_cli.store.location import Location

    loc = Location.from_url(url)
    root = loc.read_json(ROOT_META)
    root["attributes"]["cachegraft"]["format_version"] = 1
    loc.write_json_atomic(ROOT_META, root)
    return loc


@pytest.mark.parametrize("version", [1, 2])
def test_row_tables_round_trip_in_both_formats(url, rng, version):
    make(url, rng)
    loc = _as_format_1(url) if version == 1 else CacheStore.open(url).loc
    store = CacheStore.open(url)
    extra = [row(50, id="ü/naïve id", parent_id=None, chunk_index=None), row(51, parent_id="", chunk_index=0)]
    data = fill(store, rng, range(4))
    with store.writer() as w:
        for r in extra:
            data[r.id] = {"fused": bf16_cache(rng, 7)}
            w.add(r, data[r.id])
    again = CacheStore.open(url)
    files = {"rows.json", "rows.bin"}
    wanted = "rows.json" if version == 1 else "rows.bin"
    for seg in again.segments:
        assert {f for f in files if loc.exists(f"segments/{seg['name']}/{f}")} == {wanted}
    rows = {r.id: r for r in again.rows()}
    assert (rows["ü/naïve id"].parent_id, rows["ü/naïve id"].chunk_index) == (None, None)
    assert (rows["p51"].parent_id, rows["p51"].chunk_index) == ("", 0)
    assert (rows["p3"].parent_id, rows["p3"].chunk_index, rows["p3"].content_hash) == ("doc1", 0, "hash3")
    assert again.content_hashes()["ü/naïve id"] == "hash50" and again.has_hash("hash51")
    for pid, got in zip(data, again.read(list(data))):
        assert np.array_equal(got, data[pid]["fused"])
    assert again.verify()["ok"] and again.info()["format_version"] == version


def test_a_nul_in_a_passage_id_is_refused(url, rng):
    store = make(url, rng)
    with pytest.raises(UsageError, match="NUL"):
        with store.writer() as w:
            w.add(row(0, id="a\0b"), {"fused": bf16_cache(rng, 3)})
    assert len(CacheStore.open(url)) == 0
