"""Metadata is evidence, not truth (`store/evidence.py`): a hand edit to the root zarr.json, an
array's zarr.json or the manifest never becomes dropped rows, deleted segments or a silent misread.

Every command either works (and reads exactly what was written) or exits with a clean error
naming the field (exit 7 for a contradiction, never 70); `compact` refuses before it writes or
deletes; `repair` refuses, or writes the array metadata again where the rest of the store
corroborates it, and keeps every row; the original metadata put back, every passage is there.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from cli_support import run_cli
from faults import record
from store_support import bf16_cache, fill, identity, prefix, row

from cachegraft_cli.errors import CacheGraftError, StoreMetadataError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.repair import repair, undo

ROOT_EDITS = {  # the red team's one-word edits, and more of the same kind
    "codec": lambda m: m["identity"].update(codec="bf16"),
    "codec_int4": lambda m: m["identity"].update(codec="int4"),
    "kinds_empty": lambda m: m.update(kinds=[]),
    "kinds_more": lambda m: m.update(kinds=["fused", "own"]),
    "layers": lambda m: m["identity"]["geometry"].update(layers=4),
    "heads": lambda m: m["identity"]["geometry"].update(kv_heads=1),
    "chunk_zero": lambda m: m.update(chunk_tokens=0),
    "chunk_other": lambda m: m.update(chunk_tokens=8),
    "shard_odd": lambda m: m.update(shard_tokens=100),
    "compressor_unknown": lambda m: m.update(compressor={"name": "lz77"}),
    "compressor_other": lambda m: m.update(compressor={"name": "none"}),
    "codec_params": lambda m: m.update(codec_params=[1]),
}
ARRAY_EDITS = {  # (part, edit of its zarr.json)
    "data_uint8": ("data", lambda a: a.update(data_type="uint8")),
    "scale_float32": ("scale", lambda a: a.update(data_type="float32")),
    "shape_short": ("data", lambda a: a["shape"].__setitem__(0, 3)),
    "tail": ("data", lambda a: a["shape"].__setitem__(1, 2)),
    "chunk_grid": ("scale", lambda a: a["chunk_grid"]["configuration"]["chunk_shape"].__setitem__(0, 64)),
    "compressor": ("data", lambda a: a["codecs"][0]["configuration"]["codecs"][1].update(name="zstd",
                                                                                           configuration={"level": 3})),
}
COMMANDS = (["store", "info", "{s}", "--json"], ["store", "verify", "{s}"], ["store", "compact", "{s}", "--grace", "0"],
            ["store", "repair", "{s}"], ["store", "verify", "{s}"])


def _build(root: Path) -> tuple[Path, dict]:
    """An int8 store of 3 segments (data and scale parts), p0 replaced in the last one."""
    url = root / "store"
    rng = np.random.default_rng(3)
    store = CacheStore.create(str(url), identity("int8"), prefix(rng), shard_tokens=64)
    for s in range(3):
        fill(store, rng, range(s * 4, s * 4 + 4), lengths=(5, 30))
    with store.writer() as w:
        w.add(row(0, text="changed", content_hash="hash0-changed"), {"fused": bf16_cache(rng, 7)})
    opened = CacheStore.open(str(url))
    return url, dict(zip(opened.ids(), opened.read(opened.ids())))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    url, caches = _build(tmp_path_factory.mktemp("evidence"))
    return {"store": url, "caches": caches}


@pytest.fixture
def store(pristine, tmp_path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(pristine["store"], copy)
    return copy


def _edit_json(path: Path, change) -> bytes:
    before = path.read_bytes()
    doc = json.loads(before)
    change(doc)
    path.write_text(json.dumps(doc))
    return before


def _edit_root(store: Path, change) -> bytes:
    return _edit_json(store / "zarr.json", lambda d: change(d["attributes"]["cachegraft"]))


def _array(store: Path, part: str, segment: int = 0) -> Path:
    name = json.loads((store / "manifest.json").read_text())["segments"][segment]["name"]
    return store / "segments" / name / "fused" / part / "zarr.json"


def _reads_true_or_refuses(store: Path, caches: dict) -> None:
    """No silent misread: every passage reads exactly as written, or the read raises a typed error."""
    try:
        opened = CacheStore.open(str(store))
        got = dict(zip(opened.ids(), opened.read(opened.ids())))
    except CacheGraftError:
        return
    assert sorted(got) == sorted(caches)
    assert all(np.array_equal(got[k], caches[k]) for k in caches)


def _holds_everything(store: Path, caches: dict) -> None:
    opened = CacheStore.open(str(store))
    assert sorted(opened.ids()) == sorted(caches)
    assert opened.verify()["ok"], opened.verify()["problems"][:3]
    assert all(np.array_equal(a, caches[k]) for k, a in zip(opened.ids(), opened.read(opened.ids())))


def _commands(store: Path, capsys, monkeypatch) -> list[int]:
    codes = []
    for args in COMMANDS:
        code, _, err = run_cli(capsys, monkeypatch, *[str(store) if a == "{s}" else a for a in args],
                               forbid=("Traceback", "this is a bug"))
        assert code != 70, err
        codes.append(code)
    return codes


# ---------------------------------------------------------------- the red team's cases


@pytest.mark.parametrize("edit", ["codec", "kinds_empty", "layers"])
def test_a_root_edit_makes_compact_refuse_before_it_writes_or_deletes(edit, store, pristine, capsys, monkeypatch):
    """Case 2: compact exited 0 and deleted every original; now exit 7 naming the field, nothing changed."""
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    original = _edit_root(store, ROOT_EDITS[edit])
    code, _, err = run_cli(capsys, monkeypatch, "store", "compact", store, "--grace", "0",
                           forbid=("Traceback", "this is a bug"))
    assert code == 7 and "zarr.json" in err, err
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    (store / "zarr.json").write_bytes(original)
    _holds_everything(store, pristine["caches"])


def test_an_array_dtype_edit_makes_compact_refuse_and_verify_say_so(store, pristine, capsys, monkeypatch):
    """Cases 2 and 11: an int8 array relabelled uint8 read as other numbers and verify said ok."""
    _edit_json(_array(store, "data"), ARRAY_EDITS["data_uint8"][1])
    code, _, err = run_cli(capsys, monkeypatch, "store", "verify", store, forbid=("Traceback", "this is a bug"))
    assert code == 7 and "data_type" in err and "uint8" in err, err
    code, _, err = run_cli(capsys, monkeypatch, "store", "compact", store, "--grace", "0")
    assert code == 7 and "data_type" in err, err
    with pytest.raises(StoreMetadataError, match="data_type"):
        opened = CacheStore.open(str(store))
        opened.read(opened.ids())


@pytest.mark.parametrize("edit", ["codec", "kinds_more", "layers"])
def test_repair_refuses_a_root_edit_instead_of_dropping_every_row(edit, store, pristine, capsys, monkeypatch):
    """Case 4: every row was dropped for "checksum mismatch" while the bytes were intact."""
    original = _edit_root(store, ROOT_EDITS[edit])
    code, out, err = run_cli(capsys, monkeypatch, "store", "repair", store, forbid=("Traceback", "this is a bug"))
    assert code == 7 and "dropped" not in out and not (store / "quarantine").exists(), out + err
    (store / "zarr.json").write_bytes(original)
    _holds_everything(store, pristine["caches"])


@pytest.mark.parametrize("edit", ["scale_float32", "data_uint8", "shape_short"])
def test_repair_writes_a_contradicted_array_metadata_again_and_keeps_every_row(edit, store, pristine):
    """Cases 4 and 8: a scale's dtype or an array's shape edited; the other segments and the store's
    identity agree on what it was, so repair writes it again, checks the rows, and undo puts it back."""
    part, change = ARRAY_EDITS[edit]
    edited = _edit_json(_array(store, part), change) and _array(store, part).read_bytes()
    report = repair(str(store))
    assert report.ok and not report.dropped and report.metadata_restored, report
    _holds_everything(store, pristine["caches"])
    undo(str(store), report.undo.rsplit(" ", 1)[-1])
    assert _array(store, part).read_bytes() == edited and not (store / "quarantine").exists()


def test_repair_of_a_lone_segment_with_a_contradicted_array_refuses(tmp_path):
    """Nothing corroborates the store's identity (one segment, written before decode specs): exit 7."""
    rng = np.random.default_rng(1)
    store = CacheStore.create(str(tmp_path / "s"), identity("int8"), prefix(rng))
    fill(store, rng, range(3))
    entry_file = next((tmp_path / "s" / "segments").glob("*/commit.json"))
    _edit_json(entry_file, lambda e: e.pop("decodes"))
    _edit_json(tmp_path / "s" / "manifest.json", lambda m: m["segments"][0].pop("decodes"))
    _edit_json(_array(tmp_path / "s", "scale"), ARRAY_EDITS["scale_float32"][1])
    with pytest.raises(StoreMetadataError, match="data_type"):
        repair(str(tmp_path / "s"))
    assert not (tmp_path / "s" / "quarantine").exists()


@pytest.mark.parametrize("edit", ["kinds_empty", "chunk_zero", "shard_odd", "compressor_unknown", "codec_params"])
def test_a_root_field_out_of_its_schema_is_refused_on_open(edit, store):
    """Case 11: `kinds: []` and `chunk_tokens: 0` were accepted (appends then wrote 1-token chunks)."""
    _edit_root(store, ROOT_EDITS[edit])
    with pytest.raises(StoreMetadataError, match="zarr.json"):
        CacheStore.open(str(store))


def test_a_manifest_from_a_newer_format_is_refused(store, capsys, monkeypatch):
    """Case 11: manifest `format_version: 99` was accepted."""
    _edit_json(store / "manifest.json", lambda m: m.update(format_version=99))
    code, _, err = run_cli(capsys, monkeypatch, "store", "verify", store, forbid=("Traceback", "this is a bug"))
    assert code == 7 and "format_version" in err, err


def test_a_new_segment_records_its_decode_spec_and_a_root_edit_that_keeps_shapes_contradicts_it(store):
    """A codec change that keeps every part's name and shape is still caught: the commit record says."""
    entry = json.loads((store / "manifest.json").read_text())["segments"][0]
    assert entry["decodes"]["codec"] == "int8" and entry["plain_text"] is True and entry["sequence"] >= 1
    _edit_root(store, lambda m: m.update(codec_params={**m["codec_params"], "unused": 1}))
    with pytest.raises(StoreMetadataError, match="codec_params"):
        CacheStore.open(str(store))


def test_append_with_an_unknown_compressor_in_the_metadata_is_a_clean_error(store, tmp_path, capsys, monkeypatch):
    """Case 8: `encode` append exited 70; it is refused with exit 7 before any model loads."""
    _edit_root(store, ROOT_EDITS["compressor_unknown"])
    corpus = tmp_path / "more.jsonl"
    corpus.write_text(json.dumps({"id": "new", "text": "more text"}) + "\n")
    code, _, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", store,
                           forbid=("Traceback", "this is a bug", "loading"))
    assert code == 7 and "compressor" in err, err


# ---------------------------------------------------------------- the metadata fuzzer


def _mutations() -> list[tuple[str, str]]:
    return [("root", k) for k in ROOT_EDITS] + [("array", k) for k in ARRAY_EDITS]


@pytest.mark.parametrize("where,edit", _mutations())
def test_metadata_fuzz_every_command(where, edit, store, pristine, capsys, monkeypatch):
    """Each mutation x every store command: no exit 70, no silent misread, no passage deleted (the
    original metadata put back, a repair finds every passage with its very cache)."""
    if where == "root":
        path, original = store / "zarr.json", _edit_root(store, ROOT_EDITS[edit])
    else:
        part, change = ARRAY_EDITS[edit]
        path = _array(store, part, segment=1)
        original = _edit_json(path, change)
    _reads_true_or_refuses(store, pristine["caches"])
    _commands(store, capsys, monkeypatch)
    _reads_true_or_refuses(store, pristine["caches"])
    if path.exists() or where == "root":
        path.write_bytes(original)
    assert repair(str(store)).ok
    _holds_everything(store, pristine["caches"])
    record(bad_inputs=len(COMMANDS), lost=0)


def test_metadata_fuzz_random_values_seeded(pristine, tmp_path, capsys, monkeypatch):
    """Random junk in random root and array fields (types, ranges, deletions), every command."""
    junk = [None, "x", -1, 0, 1.5, 10**12, [], {}, True, "int4", ["fused"]]
    for seed in range(8):
        rng = random.Random(seed)
        store = tmp_path / f"s{seed}"
        shutil.copytree(pristine["store"], store)
        files = [store / "zarr.json", _array(store, "data", 2), _array(store, "scale", 1)]
        path = rng.choice(files)
        original = path.read_bytes()
        doc = json.loads(original)
        target = doc["attributes"]["cachegraft"] if path.name == "zarr.json" and path.parent == store else doc
        if rng.random() < 0.3 and isinstance(target.get("identity"), dict):
            target = target["identity"]["geometry"]
        key = rng.choice(sorted(target))
        if rng.random() < 0.2:
            del target[key]
        else:
            target[key] = rng.choice(junk)
        path.write_text(json.dumps(doc))
        _reads_true_or_refuses(store, pristine["caches"])
        _commands(store, capsys, monkeypatch)
        if path.exists():
            path.write_bytes(original)
        assert repair(str(store)).ok
        _holds_everything(store, pristine["caches"])
    record(bad_inputs=8 * len(COMMANDS), lost=0)
