"""`encode --sharer-notes N`: the sharer writes notes about each passage at encode time; they are
recorded in the row (the passage's own text, hash and index untouched), the stored caches are
exactly the fusion over passage plus notes, `text` reads the notes too, and the store's
setting is kept by appends and checked before any model loads."""

import numpy as np
import pytest
from tiny import fused_session, saved_open_fuser

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions
from cachegraft_cli.errors import StoreMismatchError, UsageError
from cachegraft_cli.lm import kvcache
from cachegraft_cli.session import ModelChoice, ModelSession
from cachegraft_cli.store import CacheStore
from cachegraft_cli.store.target import Target

PASSAGES = [
    Passage("harbor", "Harbor town", "Harbor town was founded in 1820 by fishermen who built the first lighthouse."),
    Passage("treaty", "Treaty", "The treaty was signed in Vienna after long talks between the two empires."),
    Passage("photo", "Photosynthesis", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."),
]


@pytest.fixture(scope="module")
def session(tiny_models, tiny_dirs, tmp_path_factory):
    return fused_session(tiny_dirs, saved_open_fuser(tiny_models, tmp_path_factory.mktemp("fuser") / "open", seed=7))


@pytest.fixture(scope="module")
def notes_store(session, tmp_path_factory):
    url = str(tmp_path_factory.mktemp("notes") / "store")
    summary = encode_corpus(PASSAGES, Target.open(url), session, EncodeOptions(codec="float32", sharer_notes=6))
    return url, summary


def test_notes_are_recorded_beside_the_passage_and_cached_with_it(session, notes_store):
    from cachegraft_cli.store.rows import with_notes

    url, summary = notes_store
    store = CacheStore.open(url)
    assert store.identity["notes"]["tokens"] == 6
    rows = store.get_rows([p.id for p in PASSAGES])
    tpl = session.template
    for row, passage in zip(rows, PASSAGES):
        notes = row.metadata["sharer_notes"]
        assert isinstance(notes, str) and row.text == passage.text  # the passage's own text is kept as it was
        assert row.read_text == with_notes(passage.text, notes)
        assert row.tokens == len(tpl.passage_ids(row.title, row.read_text))
    added = sum(r.tokens for r in rows) - sum(len(tpl.passage_ids(p.title, p.text)) for p in PASSAGES)
    assert summary.tokens == sum(r.tokens for r in rows) and added > 0  # the notes and their heading
    # exactness: the stored caches are the fusion over passage + notes (one batch, sorted by length, as encode made it)
    ids = sorted((tpl.passage_ids(r.title, r.read_text) for r in rows), key=len)
    by_len = sorted(rows, key=lambda r: r.tokens)
    for row, kv in zip(by_len, session.fusion().fuse(ids)):
        assert np.array_equal(store.read([row.id])[0], kvcache.to_token_major(kv.fused))


def test_notes_are_the_same_every_time_and_a_rerun_adds_nothing(session, notes_store, tmp_path):
    url, _ = notes_store
    again = str(tmp_path / "again")
    assert len(session.notes_written) >= len(PASSAGES)  # the session keeps what its sharer wrote ...
    session.notes_written.clear()  # ... so forget it: the sharer writes them again, greedy
    encode_corpus(PASSAGES, Target.open(again), session, EncodeOptions(codec="float32", sharer_notes=6))
    notes = lambda u: [r.metadata["sharer_notes"] for r in CacheStore.open(u).get_rows([p.id for p in PASSAGES])]  # noqa: E731
    assert notes(again) == notes(url)
    rerun = encode_corpus(PASSAGES, Target.open(url), session, EncodeOptions())
    assert rerun.added == 0 and rerun.skipped_existing == 3  # the content hashes are the passages' own


def test_text_reads_the_notes_and_retrieval_does_not_see_them(session, notes_store):
    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.retrieval.stored import build_store_index

    url, _ = notes_store
    build_store_index(url, "bm25")
    asker = Asker(url, session=session)
    hits = asker.retrieve("where was the treaty signed?", 1)
    assert [h.id for h in hits] == ["treaty"]
    _, prompt = asker.build_prompt("where was the treaty signed?", hits, AskOptions("text", 1))
    row = asker.store.get_rows(["treaty"])[0]
    notes_ids = session.template.passage_ids(row.title, row.read_text)
    assert prompt.ids[len(session.template.prefix_ids()):][: len(notes_ids)] == notes_ids


def test_the_store_setting_is_kept_and_checked_before_models_load(session, notes_store, tiny_dirs, tmp_path):
    url, _ = notes_store
    with pytest.raises(StoreMismatchError, match="sharer-notes 6"):
        encode_corpus([Passage("x", "X", "More text.")], Target.open(url), session, EncodeOptions(sharer_notes=3))
    closed = ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32"))
    with pytest.raises(UsageError, match="needs a sharer"):
        encode_corpus(PASSAGES, Target.open(str(tmp_path / "s")), closed, EncodeOptions(sharer_notes=4))
    assert "receiver" not in closed.__dict__
    with pytest.raises(UsageError, match="sharer_notes"):
        EncodeOptions(sharer_notes=-1)


def test_evaluate_variants_take_notes():
    from cachegraft_cli.evaluation.variants import check_variant

    assert check_variant("text@notes=48").store == {"notes": 48}
    with pytest.raises(UsageError, match="sharer_notes"):
        check_variant("graft@notes=5000")


def test_notes_with_a_mismatched_sharer_read_the_donors_passage_and_notes(session, notes_store, tmp_path):
    """The control of a notes store: each passage keeps its notes (the very notes a plain notes run
    writes) and its receiver KV; the sharer reads a donor's passage + notes, matched on that length."""
    from cachegraft_cli.encoding.donors import donor_tokens, pick_donors

    plain_url, _ = notes_store
    url = str(tmp_path / "control")
    encode_corpus(PASSAGES, Target.open(url),
                  session, EncodeOptions(codec="float32", sharer_notes=6, mismatched_sharer=True))
    store, plain = CacheStore.open(url), CacheStore.open(plain_url)
    assert store.identity["notes"]["tokens"] == 6 and store.identity["fuser"]["sharer_input"] == "mismatched"
    rows = {r.id: r for r in store.get_rows([p.id for p in PASSAGES])}
    assert {i: r.read_text for i, r in rows.items()} == {r.id: r.read_text for r in plain.get_rows(list(rows))}
    tpl = session.template
    ids = {i: tpl.passage_ids(r.title, r.read_text) for i, r in rows.items()}
    order = list(rows)
    picked = pick_donors(order, [rows[i].title for i in order], [len(ids[i]) for i in order])
    assert [rows[i].metadata["sharer_donor"] for i in order] == [order[d] for d in picked]
    # exactness: one batch sorted by length, as encode made it, each fused with its donor's passage + notes
    batch = sorted(order, key=lambda i: len(ids[i]))
    donors = [donor_tokens(ids[rows[i].metadata["sharer_donor"]], len(ids[i])) for i in batch]
    for i, kv in zip(batch, session.fusion().fuse([ids[i] for i in batch], donors=donors)):
        assert np.array_equal(store.read([i])[0], kvcache.to_token_major(kv.fused))
    assert not np.array_equal(store.read([batch[0]])[0], plain.read([batch[0]])[0])  # another sharer input
