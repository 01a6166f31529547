"""`encode --mismatched-sharer` and the `mismatched` system: each passage is fused with the
sharer's cache of a donor passage (nearest in length, another title), deterministically; the
store records the control and each donor; the stored caches are exactly the fusion of the
passage's own KV with the donor's sharer KV; systems and appends are checked against it."""

import json

import numpy as np
import pytest
import torch
from cli_support import run_cli
from tiny import fused_session, saved_open_fuser

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.donors import donor_tokens, pick_donors
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions
from cachegraft_cli.errors import StoreMismatchError, UsageError
from cachegraft_cli.lm import kvcache
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

TEXTS = [
    "Harbor town was founded in 1820 by fishermen who built the first lighthouse on the northern cliffs.",
    "The treaty was signed in Vienna after long talks.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside green leaves today.",
    "The quick brown fox jumps over the lazy dog near the river bank while the farmer sleeps in the barn.",
    "Numbers like 1234, 56.7 and 8% appear in reports.",
]
PASSAGES = [Passage(f"p{i}", "Same" if i < 2 else f"Title {i}", t) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def fuser_dir(tiny_models, tmp_path_factory):
    """Open gates: the sharer's cache changes the fused one."""
    return saved_open_fuser(tiny_models, tmp_path_factory.mktemp("fuser") / "open", seed=5)


_session = fused_session


def test_donors_are_other_passages_nearest_in_length_with_another_title():
    ids, titles, lengths = ["a", "b", "c", "d", "e"], ["X", "X", "Y", "Z", "X"], [10, 11, 12, 30, 13]
    donors = pick_donors(ids, titles, lengths)
    assert all(d != i for i, d in enumerate(donors))
    assert all(titles[d] != titles[i] for i, d in enumerate(donors))  # another title exists for every one
    assert [ids[d] for d in donors] == ["c", "c", "e", "e", "d"]  # a: the next longer with another title is c
    shuffled = [4, 2, 0, 3, 1]  # the choice does not depend on the corpus order
    again = pick_donors([ids[i] for i in shuffled], [titles[i] for i in shuffled], [lengths[i] for i in shuffled])
    assert {ids[i]: ids[shuffled[d]] for i, d in zip(shuffled, again)} == {ids[i]: ids[d] for i, d in enumerate(donors)}
    assert pick_donors(["a", "b"], ["X", "X"], [3, 3]) == [1, 0]  # one title only: the nearest one at all
    with pytest.raises(UsageError, match="at least two passages"):
        pick_donors(["a"], ["X"], [3])
    assert pick_donors([], [], []) == []


def test_donor_tokens_are_cut_or_repeated_to_the_passage_length():
    assert donor_tokens([1, 2, 3, 4], 3) == [1, 2, 3]
    assert donor_tokens([1, 2], 5) == [1, 2, 1, 2, 1]


def test_fusing_with_the_passage_as_its_own_donor_is_graft_bit_for_bit(tiny_dirs, fuser_dir):
    session = _session(tiny_dirs, fuser_dir)
    fusion, tpl = session.fusion(), session.template
    ids = [tpl.passage_ids(p.title, p.text) for p in PASSAGES[:3]]
    graft, same = fusion.fuse(ids), fusion.fuse(ids, donors=ids)
    for a, b in zip(graft, same):
        assert all(torch.equal(x, y) for (ka, va), (kb, vb) in zip(a.fused, b.fused) for x, y in ((ka, kb), (va, vb)))
    other = fusion.fuse(ids, donors=[donor_tokens(ids[(i + 1) % 3], len(p)) for i, p in enumerate(ids)])
    assert not torch.equal(other[0].fused[-1][1], graft[0].fused[-1][1])  # another sharer input, another cache
    assert torch.equal(other[0].own[-1][1], graft[0].own[-1][1])  # the receiver's own KV is the passage's
    with pytest.raises(ValueError, match="as long as each passage"):
        fusion.fuse(ids, donors=[i[:-1] for i in ids])


def test_the_store_records_the_control_and_holds_the_donors_fusion(tiny_dirs, fuser_dir, tmp_path):
    session = _session(tiny_dirs, fuser_dir)
    url = str(tmp_path / "mismatched")
    encode_corpus(PASSAGES, Target.open(url), session, EncodeOptions(codec="float32", mismatched_sharer=True))
    store = CacheStore.open(url)
    assert store.identity["fuser"]["sharer_input"] == "mismatched"
    rows = {r.id: r for r in store.get_rows([p.id for p in PASSAGES])}
    donors = {i: r.metadata["sharer_donor"] for i, r in rows.items()}
    assert all(d != i and rows[d].title != rows[i].title for i, d in donors.items())
    # exactness: each stored cache is the fusion of the passage's own KV with its donor's sharer KV
    # (one batch, as encode made it: the passages sorted by length, so the same kernels and bits)
    tpl, fusion = session.template, session.fusion()
    ids = {p.id: tpl.passage_ids(p.title, p.text) for p in PASSAGES}
    batch = sorted(ids, key=lambda pid: len(ids[pid]))
    fused = fusion.fuse([ids[p] for p in batch], donors=[donor_tokens(ids[donors[p]], len(ids[p])) for p in batch])
    for pid, kv in zip(batch, fused):
        assert np.array_equal(store.read([pid])[0], kvcache.to_token_major(kv.fused))
    # the same corpus gives the same donors, in any order
    again = str(tmp_path / "again")
    encode_corpus(PASSAGES[::-1], Target.open(again), session, EncodeOptions(codec="float32", mismatched_sharer=True))
    assert {r.id: r.metadata["sharer_donor"] for r in CacheStore.open(again).get_rows(list(donors))} == donors


def test_appends_keep_the_control_and_a_contrary_flag_is_refused(tiny_dirs, fuser_dir, tmp_path):
    session = _session(tiny_dirs, fuser_dir)
    url = str(tmp_path / "store")
    encode_corpus(PASSAGES[:3], Target.open(url), session, EncodeOptions(codec="float32", mismatched_sharer=True))
    more = [Passage("q1", "New", "Glaciers carve deep valleys over thousands of years."),
            Passage("q2", "Newer", "Bees dance to tell the hive where flowers are.")]
    encode_corpus(more, Target.open(url), session, EncodeOptions())  # the flag left out: the store's own
    rows = CacheStore.open(url).get_rows(["q1", "q2"])
    assert {r.metadata["sharer_donor"] for r in rows} == {"q1", "q2"}  # donors among the appended passages
    with pytest.raises(StoreMismatchError, match="mismatched-sharer"):
        encode_corpus([Passage("q3", "T", "Text.")], Target.open(url), session, EncodeOptions(mismatched_sharer=False))
    fresh = _session(tiny_dirs, fuser_dir)
    with pytest.raises(UsageError, match="at least two passages"):  # one new passage: no donor, no model loaded
        encode_corpus([Passage("q3", "T", "Text.")], Target.open(url), fresh, EncodeOptions())
    assert "receiver" not in fresh.__dict__ and "sharer" not in fresh.__dict__
    plain = str(tmp_path / "plain")
    encode_corpus(PASSAGES[:2], Target.open(plain), session, EncodeOptions(codec="float32"))
    with pytest.raises(StoreMismatchError, match="made without --mismatched-sharer"):
        encode_corpus(PASSAGES[2:], Target.open(plain), session, EncodeOptions(mismatched_sharer=True))


def test_cli_system_checks_and_refusals_before_models_load(tiny_dirs, fuser_dir, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": p.id, "title": p.title, "text": p.text}) + "\n" for p in PASSAGES))
    common = ["--receiver", tiny_dirs["receiver"], "--dtype", "float32", "--codec", "float32"]
    code, _, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", tmp_path / "closed", *common,
                           "--mismatched-sharer")
    assert code == 2 and "needs a fuser fed by the sharer" in err
    store = tmp_path / "store"
    code, out, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", store, *common, "--sharer",
                             tiny_dirs["sharer_same"], "--fuser", fuser_dir, "--mismatched-sharer", "--json")
    assert code == 0, err
    run_cli(capsys, monkeypatch, "index", "--store", store)
    code, out, err = run_cli(capsys, monkeypatch, "ask", "who built the lighthouse?", "--store", store, "--system",
                             "mismatched", "--json", "--max-new-tokens", 3)
    assert code == 0, err
    assert json.loads(out)["system"] == "mismatched"
    code, _, err = run_cli(capsys, monkeypatch, "ask", "who built the lighthouse?", "--store", store)
    assert code == 2 and "--system mismatched" in err  # graft, the default, is refused on the control
    code, _, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", store, "--no-mismatched-sharer")
    assert code == 5 and "mismatched-sharer" in err


@pytest.mark.parametrize("control", ["mismatched", "notes"])
def test_reencoding_lost_rows_uses_the_donors_and_notes_they_recorded(control, tiny_dirs, fuser_dir, tmp_path, capsys,
                                                                      monkeypatch):
    """`store verify --fix --reencode` after a segment's data is lost: the rows come back fused with
    the donor (or the notes) their rows recorded, close to the first encode (another batch)."""
    session = _session(tiny_dirs, fuser_dir)
    url = tmp_path / "store"
    setting = {"mismatched_sharer": True} if control == "mismatched" else {"sharer_notes": 5}
    encode_corpus(PASSAGES, Target.open(str(url)), session, EncodeOptions(codec="float32", commit_every=2, **setting))
    store = CacheStore.open(str(url))
    first = {pid: store.read([pid])[0] for pid in store.ids()}
    recorded = {r.id: dict(r.metadata) for r in store.get_rows(list(first))}
    lost = store.tables[1]
    for path in (url / "segments" / lost.segment / "fused" / "data" / "c").rglob("*"):
        if path.is_file():
            path.unlink()
    code, out, err = run_cli(capsys, monkeypatch, "store", "verify", url, "--fix", "--reencode", "--json")
    assert code == 0 and set(json.loads(out)["reencoded"]) == set(lost.ids), out + err
    fixed = CacheStore.open(str(url))
    assert {r.id: dict(r.metadata) for r in fixed.get_rows(list(first))} == recorded
    for pid in lost.ids:
        np.testing.assert_allclose(fixed.read([pid])[0], first[pid], rtol=2.0**-7, atol=1e-5, err_msg=pid)
