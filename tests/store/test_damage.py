"""Damage: a chunk truncated, flipped or deleted, the manifest corrupted or lost, the index
deleted or corrupted. `store verify` names what is affected and fails; `ask` fails cleanly on
an affected passage and still answers from the others; `store repair` drops the damaged
passages (or, with --reencode, encodes them again, equal up to one bf16 rounding step) and says which.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import record

from cachegraft_cli.store import CacheStore

WORDS = ["amber", "basalt", "cobalt", "dusk", "ember", "frost", "granite", "harbor", "indigo", "jade", "kelp", "lumen"]


def run(capsys, monkeypatch, *args):
    return run_cli(capsys, monkeypatch, *args, forbid=("Traceback", "this is a bug"))


@pytest.fixture(scope="module")
def pristine(tiny_dirs, tmp_path_factory):
    """12 passages in 3 segments (one shard each), indexed; each passage has its own word."""
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession

    root = tmp_path_factory.mktemp("damage")
    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": f"Entry {i}",
                                          "text": f"The {w} entry tells of {w} things."}) + "\n"
                              for i, w in enumerate(WORDS)))
    session = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    store = root / "store"
    encode_corpus(read_corpus(corpus), str(store), session, EncodeOptions(commit_every=4))
    build_store_index(str(store))
    opened = CacheStore.open(str(store))
    assert len(opened.segments) == 3
    return {"store": store, "caches": dict(zip(opened.ids(), opened.read(opened.ids()))), "corpus": corpus,
            "receiver": str(tiny_dirs["receiver"])}


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine["store"], copy)
    return copy


def _shard(store: Path, segment: str) -> Path:
    (path,) = [p for p in (store / "segments" / segment / "fused" / "data" / "c").rglob("*") if p.is_file()]
    return path


def _chunk_span(shard: Path, opened: CacheStore, chunk: int) -> tuple[int, int]:
    """(offset, length) of inner chunk `chunk` in a shard, from the shard index at its end."""
    per_shard = opened.shard_tokens // opened.chunk_tokens
    data = shard.read_bytes()
    index = np.frombuffer(data[-(per_shard * 16 + 4):-4], dtype="<u8").reshape(-1, 2)
    return int(index[chunk][0]), int(index[chunk][1])


def _damage(store: Path, how: str) -> tuple[str, set[str]]:
    """Damage the second segment; returns its name and the passages that must be named."""
    opened = CacheStore.open(str(store))
    table = opened.tables[1]
    shard = _shard(store, table.segment)
    if how == "flip":  # one inner chunk: the passages whose tokens it holds
        offset, length = _chunk_span(shard, opened, 0)
        data = bytearray(shard.read_bytes())
        for j in range(offset + 4, offset + min(length, 24)):
            data[j] ^= 0xFF
        shard.write_bytes(bytes(data))
        hit = {pid for pid, (a, b) in zip(table.ids, map(table.span, range(len(table)))) if a < opened.chunk_tokens}
    elif how == "truncate":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        hit = set(table.ids)
    else:  # delete
        shard.unlink()
        hit = set(table.ids)
    return table.segment, hit


# Encoding a passage again runs it in another batch (other passages, other padding), and float32
# matmuls of other shapes round differently in their last bits, by CPU kind (AVX2 vs AVX512 kernels).
# What is guaranteed: the cache equals the first encode up to one bf16 rounding step of the stored
# value (2^-8 relative; 2^-7 allowed) plus float32 noise near zero, and its stored checksum verifies.
REENCODE_RTOL, REENCODE_ATOL = 2.0**-7, 1e-5


def _reencoded_like_first(store: CacheStore, pid: str, first: np.ndarray) -> None:
    got = store.read([pid])[0]  # read() checks the row's crc32 against the stored checksum
    assert got.shape == first.shape, pid
    np.testing.assert_allclose(got, first, rtol=REENCODE_RTOL, atol=REENCODE_ATOL, err_msg=pid)


def _query(pid: str) -> str:
    word = WORDS[int(pid[1:])]
    return f"what about {word}?"


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_damaged_chunk_is_named_isolated_and_repaired(how, store, pristine, capsys, monkeypatch):
    segment, hit = _damage(store, how)
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--json")
    report = json.loads(out)
    assert code == 7 and segment in err
    assert {p["passage"] for p in report["problems"]} == hit and {p["segment"] for p in report["problems"]} == {segment}
    if how == "delete":
        assert all("shard file c/0 is missing" in p["problem"] for p in report["problems"])
    target = min(hit)
    code, _, err = run(capsys, monkeypatch, "ask", _query(target), "--store", store, "-k", 1, "--max-new-tokens", 2)
    assert code == 7 and repr(target) in err and segment in err and "store repair" in err
    other = "p0"  # in the first segment, untouched
    code, out, err = run(capsys, monkeypatch, "ask", _query(other), "--store", store, "-k", 1, "--max-new-tokens", 2,
                         "--json")
    assert code == 0 and json.loads(out)["passages"][0]["id"] == other, err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"], err
    assert {d["passage"] for d in result["dropped"]} == hit
    repaired = CacheStore.open(str(store))
    assert set(repaired.ids()) == set(pristine["caches"]) - hit and repaired.verify()["ok"]
    for pid, got in zip(repaired.ids(), repaired.read(repaired.ids())):
        assert np.array_equal(got, pristine["caches"][pid])  # what was kept is untouched
    code, out, err = run(capsys, monkeypatch, "ask", _query(other), "--store", store, "-k", 1, "--max-new-tokens", 2)
    assert code == 0, err  # the index was rebuilt for what is left
    if how == "flip":  # encoding the corpus again adds the dropped passages back (in another batch)
        code, out, err = run(capsys, monkeypatch, "encode", pristine["corpus"], "--store", store, "--receiver",
                             pristine["receiver"], "--dtype", "float32", "--json")
        assert code == 0 and json.loads(out)["added"] == len(hit), err
        again = CacheStore.open(str(store))
        assert sorted(again.ids()) == sorted(pristine["caches"]) and again.verify()["ok"]
        for pid in again.ids():
            if pid in hit:
                _reencoded_like_first(again, pid, pristine["caches"][pid])
            else:  # never re-encoded: the same bytes
                assert np.array_equal(again.read([pid])[0], pristine["caches"][pid])
    record(faults=1, damage=1)


def test_verify_fix_reencode_restores_damaged_passages(store, pristine, capsys, monkeypatch):
    _, hit = _damage(store, "flip")
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--fix", "--reencode", "--json")
    result = json.loads(out)
    assert code == 0 and result["ok"] and set(result["reencoded"]) == hit, err
    fixed = CacheStore.open(str(store))
    assert sorted(fixed.ids()) == sorted(pristine["caches"]) and fixed.verify()["ok"]
    for pid in fixed.ids():
        if pid in hit:
            _reencoded_like_first(fixed, pid, pristine["caches"][pid])
        else:
            assert np.array_equal(fixed.read([pid])[0], pristine["caches"][pid])
    code, out, err = run(capsys, monkeypatch, "ask", _query(min(hit)), "--store", store, "-k", 1,
                         "--max-new-tokens", 2, "--json")
    assert code == 0 and json.loads(out)["passages"][0]["id"] == min(hit), err
    record(faults=1, damage=1)


@pytest.mark.parametrize("how", ["corrupt", "delete"])
def test_manifest_damage_is_refused_and_rebuilt_from_commit_records(how, store, pristine, tiny_dirs, capsys,
                                                                     monkeypatch):
    manifest = store / "manifest.json"
    if how == "corrupt":
        manifest.write_text('{"segments": [{"name": ')
    else:
        manifest.unlink()
    code, _, err = run(capsys, monkeypatch, "store", "verify", store)
    assert code == 7 and "manifest.json" in err and "store repair" in err
    code, _, err = run(capsys, monkeypatch, "ask", _query("p0"), "--store", store)
    assert code == 7 and "manifest.json" in err
    corpus = store.parent / "c.jsonl"
    corpus.write_text(json.dumps({"id": "new", "text": "a new passage"}) + "\n")
    code, _, err = run(capsys, monkeypatch, "encode", corpus, "--store", store, "--receiver", tiny_dirs["receiver"])
    assert code == 7 and "manifest.json" in err  # refused: nothing is collected or written
    assert len([p for p in (store / "segments").iterdir() if p.is_dir()]) == 3
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    assert code == 0 and json.loads(out)["manifest"] == "rebuilt from 3 commit records", err
    again = CacheStore.open(str(store))
    assert sorted(again.ids()) == sorted(pristine["caches"]) and again.verify()["ok"]
    code, _, err = run(capsys, monkeypatch, "ask", _query("p0"), "--store", store, "--max-new-tokens", 2)
    assert code == 0, err
    record(faults=1, damage=1)


@pytest.mark.parametrize("how", ["delete", "corrupt"])
def test_index_damage_is_reported_and_rebuilt(how, store, capsys, monkeypatch):
    from cachegraft_cli.retrieval.stored import index_path

    current = Path(index_path(str(store)))
    if how == "delete":
        shutil.rmtree(current)
    else:
        (current / "passages.bin").write_bytes(b"garbage")
    code, _, err = run(capsys, monkeypatch, "ask", _query("p3"), "--store", store)
    assert code == 9 and "cachegraft index" in err
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--json")
    assert code == 7 and any(p["code"] == "index" for p in json.loads(out)["problems"]), err
    code, out, err = run(capsys, monkeypatch, "store", "repair", store)
    assert code == 0 and "rebuilt the bm25 index" in err, err
    code, out, err = run(capsys, monkeypatch, "ask", _query("p3"), "--store", store, "-k", 1, "--json",
                         "--max-new-tokens", 2)
    assert code == 0 and json.loads(out)["passages"][0]["id"] == "p3", err
    record(faults=1, damage=1)


def test_duplicate_ids_are_found_and_the_shadowed_rows_dropped(store, capsys, monkeypatch):
    """Two writers racing on stale views wrote ids twice: verify must fail, repair keeps the latest."""
    opened = CacheStore.open(str(store))
    pid = opened.ids()[0]
    row = opened.get_rows([pid])[0]
    cache = opened.read([pid])[0]
    with opened.writer({"test": "second writer"}) as w:
        w.add(row, {"fused": cache})
    code, out, err = run(capsys, monkeypatch, "store", "verify", store, "--json")
    problems = json.loads(out)["problems"]
    assert code == 7 and [p["code"] for p in problems] == ["duplicate"] and problems[0]["passage"] == pid
    code, out, err = run(capsys, monkeypatch, "store", "repair", store, "--json")
    assert code == 0 and json.loads(out)["ok"], err
    fixed = CacheStore.open(str(store))
    assert sum(len(t) for t in fixed.tables) == len(fixed.ids()) == 12
    record(faults=1, damage=1)


def test_read_of_a_damaged_chunk_raises_a_typed_error_naming_it(store):
    from cachegraft_cli.errors import StoreCorruptError

    segment, hit = _damage(store, "flip")
    opened = CacheStore.open(str(store))
    with pytest.raises(StoreCorruptError) as exc:
        opened.read(opened.ids())
    assert segment in exc.value.message and all(repr(p) in exc.value.message for p in hit)
    assert opened.read(["p0"])[0].shape[0] > 0  # the others read on
