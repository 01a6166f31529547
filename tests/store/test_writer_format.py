"""The writer's block buffers and direct shards: what it writes reads back exactly, passages
may span shards, torch tensors give the same store as numpy arrays, and stores written
before the fast writer (fixtures/format2) open, read, verify and take appends as before."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from store_support import TOKEN_SHAPE, bf16_cache, identity, prefix, row, tc_calibration

from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.codecs import CODECS

FIXTURES = Path(__file__).parent / "fixtures" / "format2"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text()) if FIXTURES.exists() else {}
OLD_CODECS = ("bf16", "int8", "int4", "float32")
PARAMS = {"int4": {"key_group": 32}, "k2v4": {"key_group": 32}, "int2": {"key_group": 32}, "k8v4": {"key_group": 32},
          "tc": {"calibration": tc_calibration()}}


def digest(arr: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(arr, "<f4").tobytes()).hexdigest()


def old_store(tmp_path, codec: str) -> str:
    dst = tmp_path / codec
    shutil.copytree(FIXTURES / codec, dst)
    return str(dst)


@pytest.mark.parametrize("codec", OLD_CODECS)
def test_stores_written_before_the_fast_writer_read_exactly_as_before(tmp_path, codec):
    store = CacheStore.open(old_store(tmp_path, codec))
    ids = sorted(store.ids())
    assert len(ids) == 8 and store.verify()["ok"]
    for pid, arr in zip(ids, store.read(ids)):
        want = EXPECTED[f"{codec}/{pid}"]
        assert list(arr.shape) == want["shape"] and digest(arr) == want["sha256"]


@pytest.mark.parametrize("codec", OLD_CODECS)
def test_appends_to_an_old_store_keep_its_passages_and_settings(tmp_path, codec):
    url = old_store(tmp_path, codec)
    rng = np.random.default_rng(3)
    new = {f"n{i}": bf16_cache(rng, int(rng.integers(20, 90))) for i in range(5)}
    with CacheStore.open(url).writer() as w:
        for pid, x in new.items():
            w.add(row(0, id=pid, content_hash=f"new-{pid}"), {"fused": x})
    again = CacheStore.open(url)
    assert again.meta["compressor"] == {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle"}
    old_ids = sorted(i for i in again.ids() if i.startswith("p"))
    assert [digest(a) for a in again.read(old_ids)] == [EXPECTED[f"{codec}/{p}"]["sha256"] for p in old_ids]
    if codec in ("bf16", "float32"):
        assert all(np.array_equal(a, new[p]) for p, a in zip(new, again.read(list(new))))
    assert again.verify()["ok"]


def make(tmp_path, codec: str, name: str = "s", **kw) -> CacheStore:
    rng = np.random.default_rng(0)
    return CacheStore.create(str(tmp_path / name), identity(codec), prefix(rng), codec_params=PARAMS.get(codec),
                             **kw)


@pytest.mark.parametrize("codec", CODECS)
def test_passages_longer_than_a_shard_round_trip(tmp_path, codec):
    """Shards of 32 tokens, passages of 1..100: passages span up to four shards, and
    decoding a passage alone gives what decoding the whole segment gives."""
    store = make(tmp_path, codec, chunk_tokens=16, shard_tokens=32 if codec in ("bf16", "int8", "float32") else 64)
    rng = np.random.default_rng(1)
    data = {f"p{i}": bf16_cache(rng, n) for i, n in enumerate([1, 100, 31, 32, 33, 64, 7, 90])}
    with store.writer() as w:
        for pid, x in data.items():
            w.add(row(0, id=pid, content_hash=pid), {"fused": x})
    again = CacheStore.open(str(tmp_path / "s"))
    codec_ = again.codec  # the store's own (a tc store's reads its calibration from the store)
    joined = np.concatenate(list(data.values()))
    positions = np.concatenate([np.arange(len(x)) for x in data.values()])  # (the tc codec un-rotates keys by them)
    whole = codec_.decode(codec_.encode(joined, positions), 0, len(joined))
    got = again.read(list(data))
    starts = np.cumsum([0] + [len(x) for x in data.values()])
    for x, start, arr in zip(data.values(), starts, got):
        assert arr.shape == x.shape
        assert np.array_equal(arr, whole[start: start + len(x)])
        if codec in ("bf16", "float32"):
            assert np.array_equal(arr, x)
    assert again.verify()["ok"]


TOKEN_SHAPE_GEOMETRY = {"layers": TOKEN_SHAPE[0], "kv_heads": TOKEN_SHAPE[2], "head_dim": TOKEN_SHAPE[3]}


@pytest.mark.parametrize("codec", ["bf16", "int4", "k2v4"])
def test_torch_tensors_make_the_same_store_as_numpy_arrays(tmp_path, codec):
    """bf16 torch tensors (as the fuser makes them) and their float32 numpy copies give
    the same stored bytes: same checksums, same decoded caches."""
    rng = np.random.default_rng(2)
    data = [bf16_cache(rng, n) for n in (40, 75, 9)]
    a, b = make(tmp_path, codec, "a"), make(tmp_path, codec, "b")
    with a.writer() as wa, b.writer() as wb:
        for i, x in enumerate(data):
            wa.add(row(i), {"fused": x})
            wb.add(row(i), {"fused": torch.from_numpy(x).to(torch.bfloat16)})
    a, b = CacheStore.open(str(tmp_path / "a")), CacheStore.open(str(tmp_path / "b"))
    assert [t.checksum(i, "fused") for t in a.tables for i in range(len(t))] == \
        [t.checksum(i, "fused") for t in b.tables for i in range(len(t))]
    ids = [f"p{i}" for i in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a.read(ids), b.read(ids)))


@pytest.mark.parametrize("codec", ["int8", "int4", "k2v4"])
def test_a_float32_cache_after_bf16_ones_is_staged_exactly(tmp_path, codec):
    """The quantisers stage bf16 tensors as bf16 (half the buffer, widened on the device at
    encode); a float32 cache that bf16 would round, added to the same block later, widens the
    buffer first: the store equals one written from float32 arrays throughout."""
    rng = np.random.default_rng(4)
    data = [bf16_cache(rng, 30), bf16_cache(rng, 20), rng.normal(size=(25,) + TOKEN_SHAPE).astype(np.float32)]
    assert not np.array_equal(data[2], torch.from_numpy(data[2]).to(torch.bfloat16).float().numpy())
    a, b = make(tmp_path, codec, "a"), make(tmp_path, codec, "b")
    with a.writer() as wa, b.writer() as wb:
        for i, x in enumerate(data):
            wa.add(row(i), {"fused": x})
            wb.add(row(i), {"fused": torch.from_numpy(x).to(torch.bfloat16) if i < 2 else x})
    a, b = CacheStore.open(str(tmp_path / "a")), CacheStore.open(str(tmp_path / "b"))
    ids = [f"p{i}" for i in range(3)]
    assert all(np.array_equal(x, y) for x, y in zip(a.read(ids), b.read(ids)))
    assert a.verify()["ok"] and b.verify()["ok"]


def test_a_cache_that_does_not_convert_aborts_the_session(tmp_path):
    store = make(tmp_path, "bf16")
    w = store.writer()
    with pytest.raises((TypeError, ValueError)):
        w.add(row(0), {"fused": np.full((3,) + TOKEN_SHAPE, "x", dtype=object)})
    assert w.closed and not CacheStore.open(str(tmp_path / "s")).segments


@pytest.mark.parametrize("url", ["local", "memory://pieces-test"])
def test_a_file_written_in_pieces_is_their_concatenation(tmp_path, url):
    """Shards reach the disk as pieces (no joined copy locally; one put on an object store)."""
    from cachegraft_cli.store.location import Location
    from cachegraft_cli.store.shards import encode_shard, shard_pieces

    loc = Location.from_url(str(tmp_path / "loc") if url == "local" else url)
    rows = np.arange(3 * 2 * 5, dtype=np.int8).reshape(3, 2, 5)
    pieces = shard_pieces(rows, 2, 4, None)
    loc.write_bytes("a/b/c/0", pieces)
    loc.write_bytes("a/b/whole", encode_shard(rows, 2, 4, None))
    assert loc.read_bytes("a/b/c/0") == b"".join(pieces) == loc.read_bytes("a/b/whole")
    assert len(pieces) == 2 * 2 + 2  # two chunks with their crc32c, then the index and its crc32c
