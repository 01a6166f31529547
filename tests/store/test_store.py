"""Codecs and table formats of the store, on a local directory and on fsspec memory:// (the contract
every URL kind passes is `store_suite.py`, run by `test_store_urls.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from store_support import bf16_cache, fill, make, memory_url, row

from cachegraft_cli.errors import UsageError
from cachegraft_cli.store import CacheStore


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    return str(tmp_path / "store") if request.param == "local" else memory_url()


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
