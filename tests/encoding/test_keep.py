"""`encode --keep R`: pruned stores keep a share of each passage's tokens, chosen after
fusion, at their original positions; `--keep 1` is the unpruned store, byte for byte."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tiny import fused_session, saved_open_fuser

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.keep import kept_count
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions
from cachegraft_cli.errors import StoreMismatchError, UsageError
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

TEXTS = [
    "Harbor town was founded in 1820 by fishermen who built the first lighthouse on the northern cliffs.",
    "The treaty was signed in Vienna after long talks between the two empires and their many allies.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside green leaves.",
    "The quick brown fox jumps over the lazy dog near the river bank while the farmer sleeps.",
    "Numbers like 1234, 56.7 and 8% appear in reports every single year, said the statistician.",
]


def _passages(n, start=0):
    return [Passage(f"p{i}", f"Title {i}", TEXTS[i % len(TEXTS)] + f" Item {i}.") for i in range(start, start + n)]


@pytest.fixture(scope="module")
def session(tiny_models, tiny_dirs, tmp_path_factory):
    """receiver <- sharer_same through a random fuser with open gates (fusion is not the identity)."""
    return fused_session(tiny_dirs, saved_open_fuser(tiny_models, tmp_path_factory.mktemp("fuser") / "open", seed=3))


def _normalised_files(store_dir: Path) -> dict[str, str]:
    """sha256 of every file, segment names replaced by their order and time stamps dropped
    (each write names its segment by time and host; nothing else may differ)."""
    manifest = json.loads((store_dir / "manifest.json").read_text())
    names = {seg["name"]: f"seg{i}" for i, seg in enumerate(manifest["segments"])}
    out = {}
    for p in sorted(store_dir.rglob("*")):
        if not p.is_file() or p.name == "writer.lock":
            continue
        rel = str(p.relative_to(store_dir))
        for name, short in names.items():
            rel = rel.replace(name, short)
        data = p.read_bytes()
        if p.suffix == ".json":
            data = _without_stamps(json.loads(data), names)
        out[rel] = hashlib.sha256(data).hexdigest()
    return out


def _without_stamps(doc, names) -> bytes:
    text = json.dumps(doc, sort_keys=True)
    for name, short in names.items():
        text = text.replace(name, short)
    doc = json.loads(text)
    for entry in [doc, *doc.get("segments", []), (doc.get("attributes") or {}).get("cachegraft") or {}]:
        if isinstance(entry, dict):
            for stamp in ("committed", "created", "updated"):
                entry.pop(stamp, None)
    return json.dumps(doc, sort_keys=True).encode()


def test_kept_count():
    assert [kept_count(n, 0.5) for n in (1, 2, 3, 4, 10, 11)] == [1, 2, 2, 2, 5, 6]
    assert kept_count(100, 0.25) == 25 and kept_count(7, 1.0) == 7 and kept_count(5, 0.01) == 2


def test_keep_1_writes_the_unpruned_store_byte_for_byte(session, tmp_path):
    plain = encode_corpus(_passages(5), Target.open(str(tmp_path / "plain")),
                                    session, EncodeOptions(codec="bf16", batch_size=2))
    kept = encode_corpus(_passages(5), Target.open(str(tmp_path / "keep1")), session,
                         EncodeOptions(codec="bf16", batch_size=2, keep=1.0, keep_by="even"))
    assert plain.bytes == kept.bytes and kept.stored_tokens == kept.tokens
    a, b = _normalised_files(tmp_path / "plain"), _normalised_files(tmp_path / "keep1")
    assert a == b and any("/fused/" in name for name in a)
    store = CacheStore.open(str(tmp_path / "keep1"))
    assert store.keep is None and "keep" not in store.identity
    assert not any(t.pruned for t in store.tables) and store.positions(["p0"]) == [None]


@pytest.mark.parametrize("by", ["attention", "norm", "even"])
def test_pruned_cache_is_the_kept_slice_of_the_full_cache(session, tmp_path, by):
    full_url, pruned_url = str(tmp_path / "full"), str(tmp_path / f"pruned-{by}")
    options = dict(codec="float32", batch_size=5, also_own_cache=True)
    encode_corpus(_passages(5), Target.open(full_url), session, EncodeOptions(**options))
    summary = encode_corpus(_passages(5), Target.open(pruned_url),
                                      session, EncodeOptions(**options, keep=0.5, keep_by=by))
    full, pruned = CacheStore.open(full_url), CacheStore.open(pruned_url)
    assert pruned.keep == {"ratio": 0.5, "by": by}
    ids = [f"p{i}" for i in range(5)]
    assert summary.stored_tokens == sum(kept_count(len(a), 0.5) for a in full.read(ids))
    for pid, (positions, span) in zip(ids, pruned.positions(ids)):
        for kind in ("fused", "own"):
            whole, kept = full.read([pid], kind)[0], pruned.read([pid], kind)[0]
            assert span == len(whole) and len(kept) == kept_count(span, 0.5)
            assert positions[0] == 0 and positions[-1] == span - 1 and np.all(np.diff(positions) > 0)
            np.testing.assert_array_equal(kept, whole[positions])  # same bits, same batch
    row = pruned.get_rows(["p1"])[0]
    assert row.pruned and row.span_tokens == len(full.read(["p1"])[0]) and len(row.positions) == row.tokens
    assert pruned.verify()["ok"]


def test_attention_keeps_other_tokens_than_even_spacing(session, tmp_path):
    chosen = {}
    for by in ("attention", "even"):
        url = str(tmp_path / by)
        encode_corpus(_passages(5), Target.open(url), session, EncodeOptions(codec="bf16", keep=0.5, keep_by=by))
        chosen[by] = [p.tolist() for p, _ in CacheStore.open(url).positions([f"p{i}" for i in range(5)])]
    assert chosen["attention"] != chosen["even"]


def test_append_uses_the_store_keep_and_refuses_another(session, tmp_path):
    url = str(tmp_path / "s")
    encode_corpus(_passages(2), Target.open(url), session, EncodeOptions(codec="bf16", keep=0.5, keep_by="even"))
    more = encode_corpus(_passages(4), Target.open(url), session, EncodeOptions())  # no --keep: the store's
    store = CacheStore.open(url)
    assert more.added == 2 and all(t.pruned for t in store.tables) and len(store.tables) == 2
    for keep, by in ((1.0, None), (0.25, None), (None, "norm")):
        with pytest.raises(StoreMismatchError, match="--keep 0.5 \\(by even\\)") as err:
            encode_corpus(_passages(6), Target.open(url), session, EncodeOptions(keep=keep, keep_by=by))
        assert "--keep 0.5 --keep-by even" in err.value.hint
    plain = str(tmp_path / "plain")
    encode_corpus(_passages(1), Target.open(plain), session, EncodeOptions(codec="bf16"))
    with pytest.raises(StoreMismatchError, match="every token") as err:
        encode_corpus(_passages(2), Target.open(plain), session, EncodeOptions(keep=0.5))
    assert "Drop --keep" in err.value.hint


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "half"])
def test_bad_keep_is_refused(bad):
    with pytest.raises(UsageError, match="keep must be"):
        EncodeOptions(keep=bad)


def test_bad_keep_method_is_refused():
    with pytest.raises(UsageError, match="unknown keep method"):
        EncodeOptions(keep=0.5, keep_by="random")


def test_cli_encode_keep_and_store_info_ratio(tiny_dirs, tmp_path, capsys, monkeypatch):
    from cli_support import run_cli

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in _passages(4)))
    common = ["--receiver", tiny_dirs["receiver"], "--fuser", "closed", "--device", "cpu", "--dtype", "float32",
              "--codec", "bf16"]  # tiny geometries' int8 scales outweigh what pruning saves
    reports = {}
    for keep in ("1", "0.5"):
        store = tmp_path / f"s{keep}"
        code, out, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", store, "--keep", keep, *common)
        assert code == 0, err
        code, out, _ = run_cli(capsys, monkeypatch, "store", "info", store, "--json")
        reports[keep] = json.loads(out)
        code, text, _ = run_cli(capsys, monkeypatch, "store", "info", store)
        assert "stored / raw fused" in text and ("of each passage's tokens" in text) == (keep == "0.5")
    full, half = reports["1"], reports["0.5"]
    assert full["keep"] is None and half["keep"] == {"ratio": 0.5, "by": "even"}
    assert half["passage_tokens"] == full["passage_tokens"] == full["tokens"] > half["tokens"]
    assert full["ratio_to_raw_bf16_full"]["fused"] == pytest.approx(full["ratio_to_raw_bf16"]["fused"])
    assert half["ratio_to_raw_bf16_full"]["fused"] < 0.6 * full["ratio_to_raw_bf16_full"]["fused"]
    code, _, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", tmp_path / "s0.5", "--keep", "0.25",
                           *common)
    assert code != 0 and code != 70 and "--keep 0.5 (by even)" in err
    code, _, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", tmp_path / "bad", "--keep", "1.5", *common)
    assert code != 0 and code != 70 and "keep must be" in err


def test_compaction_and_repair_keep_a_pruned_store_readable(session, tmp_path):
    """Merging pruned segments (compact) and rewriting one without a dropped row (repair) carry the
    kept positions along: the same caches at the same positions afterwards."""
    from cachegraft_cli.store.compact import CompactOptions, compact
    from cachegraft_cli.store.repair import repair

    url = str(tmp_path / "s")
    for n in (2, 4, 6):  # three segments
        encode_corpus(_passages(n), Target.open(url), session, EncodeOptions(codec="float32", keep=0.5, keep_by="even"))
    before = CacheStore.open(url)
    ids = before.ids()
    caches = before.read(ids)
    positions = [(kept.tolist(), span) for kept, span in before.positions(ids)]
    assert len(before.tables) == 3
    compact(url, CompactOptions(grace_seconds=0))
    after = CacheStore.open(url)
    assert len(after.tables) == 1 and after.tables[0].pruned
    assert all(np.array_equal(a, b) for a, b in zip(after.read(ids), caches))
    assert [(kept.tolist(), span) for kept, span in after.positions(ids)] == positions
    repair(url)  # nothing to drop: the store reads as before
    again = CacheStore.open(url)
    assert [(kept.tolist(), span) for kept, span in again.positions(ids)] == positions
