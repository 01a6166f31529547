"""The store suite: every test runs on a local directory and on fsspec memory://."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import bf16_cache, files_under, fill, flip_bytes, identity, memory_url, prefix, row, shard_files

from cachegraft_cli.errors import StoreError, StoreLockedError, StoreMismatchError, StoreNotFoundError, UsageError
from cachegraft_cli.store import CacheStore, PassageRow


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
    assert (r.title, r.text, r.content_hash, r.metadata) == ("Title 4", "passage text 4", "hash4",
                                                             {"n": 4, "tags": ["a", "b"]})
    assert (r.parent_id, r.chunk_index) == ("doc1", 1)
    assert r.tokens == len(again.read(["p4"])[0]) and r.segment == again.segments[0]["name"]
    assert again.get_rows(["p2"])[0] == rows["p2"]
    assert np.array_equal(again.prefix(), pre)
    assert again.prefix_token_ids == [1, 2, 3, 4]
    assert again.identity["receiver"] == {"name": "tiny/receiver", "revision": "r1"}
    assert again.has_hash("hash5") and not again.has_hash("hash6")


def _int4_bounds(data: dict, rows: list, kind: str, key_group: int, zero_point: bool) -> dict:
    """Per passage, the largest |error| the int4 codec allows for keys and values: half a step.
    Keys share a step per channel per `key_group` tokens of the segment (a group may span
    passages); values per token per head (head_dim 8 < value_group). Symmetric: step = max|x| / 7;
    zero point: (max - min) / 15, plus the float16 zero's rounding down (<= 2^-10 |min|)."""
    slack = 1 + 2**-9  # float16 scales are rounded up by at most one ulp
    keys = np.concatenate([data[r.id][kind][:, :, 0] for r in sorted(rows, key=lambda r: r.offset)])
    groups = -(-len(keys) // key_group)
    padded = np.concatenate([keys, np.repeat(keys[-1:], groups * key_group - len(keys), axis=0)])
    g = padded.reshape((groups, key_group) + keys.shape[1:])

    def half_step(lo, hi):
        if not zero_point:
            return np.maximum(-lo, hi) / 7 / 2 * slack + 1e-7
        return (hi - lo + np.abs(lo) * 2**-10) / 15 / 2 * slack + 1e-7

    kb = np.repeat(half_step(g.min(axis=1), g.max(axis=1)), key_group, axis=0)
    out = {}
    for r in rows:
        v = data[r.id][kind][:, :, 1]
        out[r.id] = (kb[r.offset: r.offset + r.tokens], half_step(v.min(-1, keepdims=True), v.max(-1, keepdims=True)))
    return out


@pytest.mark.parametrize("codec,params", [("int8", None), ("int4", None),
                                          ("int4", {"key_group": 32, "value_group": 64, "zero_point": False})])
def test_quantised_codecs_stay_within_their_error_bound(url, rng, codec, params):
    store = make(url, rng, codec=codec, codec_params=params)
    data = fill(store, rng, range(12), lengths=(30, 90))
    again = CacheStore.open(url)
    if codec == "int4":
        p = again.codec.params
        bounds = _int4_bounds(data, again.rows(), "fused", p["key_group"], p["zero_point"])
    for pid, got in zip(data, again.read(list(data))):
        x = data[pid]["fused"]
        err = np.abs(got - x)
        if codec == "int8":  # one scale per (token, layer, K/V, head): |error| <= (maxabs / 127) / 2
            assert (err <= np.abs(x).max(axis=-1, keepdims=True) / 127 / 2 * (1 + 2**-9) + 1e-7).all()
        else:
            assert (err[:, :, 0] <= bounds[pid][0]).all() and (err[:, :, 1] <= bounds[pid][1]).all()
        rel = np.linalg.norm(got - x) / np.linalg.norm(x)
        assert rel < (0.01 if codec == "int8" else 0.15)


def test_int4_zero_point_is_the_default_and_halves_the_error_of_offset_data(url, rng):
    """Keys with a per-channel offset (as real keys have) are where the zero point pays."""
    errors = {}
    for zero_point in (True, False):
        u = f"{url}-{zero_point}"
        params = None if zero_point else {"key_group": 128, "value_group": 64, "zero_point": False}
        store = make(u, rng, codec="int4", codec_params=params)
        x = bf16_cache(rng, 200) + np.float32(3.0)
        with store.writer() as w:
            w.add(row(0), {"fused": x})
        again = CacheStore.open(u)
        assert again.codec.params["zero_point"] is zero_point
        errors[zero_point] = np.linalg.norm(again.read(["p0"])[0] - x) / np.linalg.norm(x)
    assert errors[True] < errors[False] / 2


def test_int4_store_from_before_zero_points_still_decodes_symmetric(url, rng):
    """Stores written before the `zero_point` parameter existed have codec_params without it;
    they must keep decoding as the symmetric codec that wrote them."""
    old = {"key_group": 32, "value_group": 64, "zero_point": False}
    store = make(url, rng, codec="int4", codec_params=old)
    data = fill(store, rng, range(4), lengths=(30, 90))
    root = store.loc.read_json("zarr.json")
    del root["attributes"]["cachegraft"]["codec_params"]["zero_point"]
    store.loc.write_json_atomic("zarr.json", root)
    again = CacheStore.open(url)
    assert again.codec.params == {**old, "value_group": 8}
    assert [c.name for c in again.codec.components()] == ["data", "kscale", "vscale"]
    fill(again, rng, range(4, 6), lengths=(30, 90))  # appends keep the store's codec
    for pid, got in zip(["p1", "p3"], CacheStore.open(url).read(["p1", "p3"])):
        assert np.linalg.norm(got - data[pid]["fused"]) / np.linalg.norm(data[pid]["fused"]) < 0.15


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
    shards = ({f"{r.offset // 1024}/0/0/0/0" for r in rows}
              | {f"{(r.offset + r.tokens - 1) // 1024}/0/0/0/0" for r in rows})
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
    assert all(t.content is None for t in reopened.tables)  # no text was loaded


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
