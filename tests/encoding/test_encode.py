"""`cachegraft encode`: idempotent, resumable, appends without rewriting,
splits long passages, survives SIGKILL."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions, split_passage
from cachegraft_cli.errors import CorpusError, StoreMismatchError, UsageError
from cachegraft_cli.session import ModelChoice, ModelSession
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

TEXTS = [
    "Harbor town was founded in 1820 by fishermen who built the first lighthouse.",
    "The treaty was signed in Vienna after long talks between the two empires.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Numbers like 1234, 56.7 and 8% appear in reports every single year.",
    "Question: who built the lighthouse? Answer: the fishermen of Harbor town.",
]


def _passages(n, start=0):
    return [Passage(f"p{i}", f"Title {i}", TEXTS[i % len(TEXTS)] + f" Item {i}.") for i in range(start, start + n)]


@pytest.fixture(scope="module")
def session(tiny_dirs):
    return ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))


def _files(store_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(store_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((store_dir / "segments").rglob("*")) if p.is_file()}


def test_rerun_is_idempotent_and_append_keeps_old_chunks(session, tmp_path):
    url = str(tmp_path / "s")
    first = encode_corpus(_passages(3), Target.open(url), session, EncodeOptions(codec="float32", batch_size=2))
    assert first.added == 3 and len(first.segments) == 1
    before = _files(tmp_path / "s")
    again = encode_corpus(_passages(3), Target.open(url), session, EncodeOptions(codec="float32"))
    assert again.added == 0 and again.skipped_existing == 3 and again.segments == []
    more = encode_corpus(_passages(5), Target.open(url), session, EncodeOptions(codec="float32"))
    assert more.added == 2 and more.skipped_existing == 3
    after = _files(tmp_path / "s")
    assert all(after[name] == digest for name, digest in before.items())  # nothing rewritten
    store = CacheStore.open(url)
    assert sorted(store.ids()) == [f"p{i}" for i in range(5)] and store.verify()["ok"]


def test_changed_text_for_a_stored_id_is_refused(session, tmp_path):
    url = str(tmp_path / "s")
    encode_corpus(_passages(2), Target.open(url), session, EncodeOptions(codec="float32"))
    changed = [Passage("p1", "Title 1", "Completely different text now.", source="c.jsonl", line=2)]
    with pytest.raises(CorpusError, match=r"c\.jsonl:2: passage 'p1' is already in the store"):
        encode_corpus(changed, Target.open(url), session, EncodeOptions(codec="float32"))


def test_codec_change_never_reuses_the_store(session, tmp_path):
    url = str(tmp_path / "s")
    encode_corpus(_passages(1), Target.open(url), session, EncodeOptions(codec="float32"))
    with pytest.raises(StoreMismatchError, match="codec"):
        encode_corpus(_passages(1), Target.open(url), session, EncodeOptions(codec="bf16"))


def test_long_passages_are_split_never_truncated(session):
    template = session.template
    long = Passage("long", "A title", " ".join(TEXTS * 3))
    chunks = split_passage(long, template, max_tokens=40)
    assert len(chunks) > 2
    assert all(len(c.ids) <= 40 for c in chunks)
    assert [c.id for c in chunks] == [f"long#{i}" for i in range(len(chunks))]
    assert " ".join(c.text for c in chunks).split() == long.text.split()  # every word kept, in order
    spans = [c.span for c in chunks]
    assert spans[0][0] == 0 and spans[-1][1] == len(long.text) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("overlap", [6, 12])
def test_an_overlap_repeats_the_end_of_each_chunk_at_a_word_start(session, overlap):
    template = session.template
    long = Passage("long", "A title", " ".join(TEXTS * 3))
    plain = split_passage(long, template, max_tokens=40)
    chunks = split_passage(long, template, max_tokens=40, overlap=overlap)
    assert all(len(c.ids) <= 40 for c in chunks) and len(chunks) > len(plain)
    spans = [c.span for c in chunks]
    assert spans[0][0] == 0 and spans[-1][1] == len(long.text)
    repeats = 0
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a0 < b0 <= a1 < b1  # each chunk moves on
        assert long.text[b0 - 1].isspace() or long.text[b0].isspace()  # from a word start
        repeated = template.tokenizer(long.text[b0:a1].strip(), add_special_tokens=False)["input_ids"]
        assert len(repeated) <= overlap + 1  # +1: a word's first token re-tokenised without its space
        repeats += b0 < a1
    assert repeats >= len(spans) // 2  # a chunk repeats nothing only where no word starts in its overlap
    covered = " ".join(long.text[a:b] for a, b in spans)
    assert set(covered.split()) == set(long.text.split())


def test_overlap_zero_splits_as_before_and_a_bad_overlap_is_refused(session):
    long = Passage("long", "A title", " ".join(TEXTS * 3))
    assert [c.span for c in split_passage(long, session.template, 40, overlap=0)] == \
        [c.span for c in split_passage(long, session.template, 40)]
    for bad in (-1, 257, "8", 1.5):
        with pytest.raises(UsageError, match="chunk_overlap"):
            EncodeOptions(max_passage_tokens=512, chunk_overlap=bad)
    assert EncodeOptions(max_passage_tokens=512, chunk_overlap=256).chunk_overlap == 256


def test_another_chunking_of_a_stored_passage_is_refused_with_what_to_do(session, tmp_path):
    url = str(tmp_path / "s")
    long = Passage("long", "T", " ".join(TEXTS * 2), source="c.jsonl", line=1)
    encode_corpus([long], Target.open(url), session, EncodeOptions(codec="float32", max_passage_tokens=48))
    with pytest.raises(CorpusError, match="split differently.*--chunk-overlap"):
        encode_corpus([long], Target.open(url), session,
                      EncodeOptions(codec="float32", max_passage_tokens=48, chunk_overlap=12))
    with pytest.raises(CorpusError, match="'long' is already in the store.*split differently"):  # now fits whole
        encode_corpus([long], Target.open(url), session, EncodeOptions(codec="float32", max_passage_tokens=4096))


def test_split_is_recorded_in_the_store(session, tmp_path):
    url = str(tmp_path / "s")
    summary = encode_corpus([Passage("long", "T", " ".join(TEXTS * 2))], Target.open(url), session,
                            EncodeOptions(codec="float32", max_passage_tokens=48))
    rows = CacheStore.open(url).rows()
    assert summary.chunks_split == len(rows) - 1 > 0
    assert {r.parent_id for r in rows} == {"long"} and sorted(r.chunk_index for r in rows) == list(range(len(rows)))
    assert all("char_span" in r.metadata for r in rows)


def _encode_cmd(corpus, store, receiver, commit_every):
    return [sys.executable, "-m", "cachegraft_cli", "encode", str(corpus), "--store", str(store), "--receiver",
            str(receiver), "--dtype", "float32", "--codec", "float32", "--batch-size", "1", "--commit-every",
            str(commit_every), "--json"]


def test_sigkill_mid_encode_then_rerun_equals_uninterrupted(tiny_dirs, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in _passages(12)))
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_encode_cmd(corpus, killed, tiny_dirs["receiver"], 1), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = killed / "manifest.json"
    deadline = time.time() + 600  # start-up (torch import, model load) is slow on a loaded machine
    while time.time() < deadline and proc.poll() is None:
        if manifest.exists() and len(json.loads(manifest.read_text()).get("segments", [])) >= 2:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "encode finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = CacheStore.open(str(killed))
    assert partial.verify()["ok"] and 2 <= len(partial) < 12
    subprocess.run(_encode_cmd(corpus, killed, tiny_dirs["receiver"], 1), env=env, check=True, capture_output=True)
    clean = tmp_path / "clean"
    subprocess.run(_encode_cmd(corpus, clean, tiny_dirs["receiver"], 100), env=env, check=True, capture_output=True)
    a, b = CacheStore.open(str(killed)), CacheStore.open(str(clean))
    ids = [f"p{i}" for i in range(12)]
    assert sorted(a.ids()) == sorted(ids) and len(a) == 12 and a.verify()["ok"]
    for x, y in zip(a.read(ids), b.read(ids)):
        assert np.array_equal(x, y)


def test_store_with_own_caches_keeps_them_and_cannot_gain_them(session, tmp_path):
    url = str(tmp_path / "s")
    encode_corpus(_passages(1), Target.open(url), session, EncodeOptions(codec="float32", also_own_cache=True))
    encode_corpus(_passages(2), Target.open(url), session, EncodeOptions(codec="float32"))  # own caches written anyway
    store = CacheStore.open(url)
    assert store.kinds == ("fused", "own") and len(store.read(["p1"], kind="own")) == 1
    plain = str(tmp_path / "plain")
    encode_corpus(_passages(1), Target.open(plain), session, EncodeOptions(codec="float32"))
    with pytest.raises(StoreMismatchError, match="without own caches"):
        encode_corpus(_passages(2), Target.open(plain), session, EncodeOptions(codec="float32", also_own_cache=True))


def test_unknown_codec_fails_before_any_model_loads():
    from cachegraft_cli.errors import UsageError

    with pytest.raises(UsageError, match="int5") as exc:
        EncodeOptions(codec="int5")
    assert "int4" in exc.value.hint


def test_one_encode_parses_the_store_once_and_reads_its_metadata_once(session, tmp_path, monkeypatch):
    """The store is opened once per command (`store.target.Target`) and that handle passed down:
    an append with nothing new parses the URL once and reads zarr.json once."""
    from cachegraft_cli.encoding.run import encode_into
    from cachegraft_cli.store import location, store as store_mod

    url = str(tmp_path / "s")
    encode_corpus(_passages(2), Target.open(url), session, EncodeOptions(codec="float32"))
    parses, metas = [], []
    real_parse, real_meta = location.Location.from_url.__func__, store_mod.read_meta

    def parse(cls, where, *args, **kwargs):
        if not isinstance(where, location.Location):
            parses.append(where)
        return real_parse(cls, where, *args, **kwargs)

    def meta(loc):
        metas.append(loc.url)
        return real_meta(loc)

    monkeypatch.setattr(location.Location, "from_url", classmethod(parse))
    monkeypatch.setattr(store_mod, "read_meta", meta)
    monkeypatch.setattr("cachegraft_cli.store.target.read_meta", meta)
    summary = encode_into(url, _passages(2), EncodeOptions(), receiver=session.choice.receiver, dtype="float32")
    assert summary.skipped_existing == 2 and summary.added == 0
    assert parses == [url] and len(metas) == 1


def test_a_tc_store_from_a_fitted_calibration_holds_the_lossless_caches_closely(session, tmp_path):
    """encode (float32) -> store calibrate -> encode --codec tc --calibration: the tc store reads
    back the lossless caches within the codec's error, keeps its calibration, and takes appends;
    naming another calibration for it later is refused."""
    from typer.testing import CliRunner

    from cachegraft_cli.cli.app import app
    from cachegraft_cli.encoding.calibration import load_file
    from cachegraft_cli.errors import UsageError

    lossless, cal_file = str(tmp_path / "f32"), tmp_path / "cal.safetensors"
    corpus = _passages(90)
    encode_corpus(corpus, Target.open(lossless), session, EncodeOptions(codec="float32", batch_size=8))
    result = CliRunner().invoke(app, ["store", "calibrate", lossless, "--out", str(cal_file), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tokens"] >= 1000 and report["sha256"] == load_file(cal_file).sha256
    assert report["weighting"] == "receiver"  # the default: the error shaped by the store's receiver
    bits = report["bits_per_element"]
    assert 0 < bits < 16 and report["ratio_to_raw_bf16"] == round(bits / 16, 4)
    url = str(tmp_path / "tc")
    options = EncodeOptions(codec="tc", batch_size=8, calibration=str(cal_file))
    encode_corpus(corpus[:60], Target.open(url), session, options)
    encode_corpus(corpus, Target.open(url),
                  session, EncodeOptions(codec="tc", batch_size=8))  # an append: the store's own
    store, reference = CacheStore.open(url), CacheStore.open(lossless)
    ids = [p.id for p in corpus]
    got, want = store.read(ids), reference.read(ids)
    err = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(got, want)) / sum((b**2).sum() for b in want))
    assert err < 0.1
    info = store.info()
    assert info["codec_tables"]["sha256"] == report["sha256"] and store.verify()["ok"]
    assert info["codec_tables"]["weighting"] == "receiver" and info["codec_tables"]["layer_steps"] is False
    assert info["ratio_to_raw_bf16"]["fused"] < reference.info()["ratio_to_raw_bf16"]["fused"] / 4
    with pytest.raises(UsageError, match="keeps the calibration it was made with"):
        encode_corpus(_passages(2, 200), Target.open(url), session, options)
