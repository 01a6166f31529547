"""Hostile input to the library (Reliability round 3): NULs, lone surrogates, bytes, values JSON
cannot hold, numbers that underflow or overflow, wrong containers. Each is a typed
`CacheGraftError` before any model loads and before anything is written, never a raw
TypeError / ValueError / UnicodeEncodeError / RecursionError (or a process abort)."""

from __future__ import annotations

import json
import shutil
import sys
import time

import pytest
from faults import record

import cachegraft_cli as cg
from cachegraft_cli.errors import CacheGraftError, CorpusError, StoreError, StoreMismatchError, UsageError

PASSAGES = [
    {"id": "harbor", "title": "Harbor town",
     "text": "Harbor town was founded in 1820 by fishermen who built the first lighthouse."},
    {"id": "treaty", "title": "Treaty",
     "text": "The treaty was signed in Vienna after long talks between the two empires."},
]
QUESTION = "who built the lighthouse?"
NAN, INF = float("nan"), float("inf")


def _rx(c):
    """The tiny receiver as `cg.encode`'s models."""
    return cg.Models(receiver=c["receiver"])


@pytest.fixture(scope="module")
def store(tiny_dirs, tmp_path_factory):
    """Two passages (the tiny receiver: 4 layers, float32), indexed."""
    path = tmp_path_factory.mktemp("hostile") / "store"
    cg.encode(PASSAGES, path, models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"),
              options=cg.EncodeOptions(codec="float32"))
    cg.index(path)
    return path


def _cycle() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def _meta(**extra) -> list[dict]:
    return [{"id": "a", "title": "T", "text": "Harbor town was founded in 1820.", **extra}]


def _new(c):
    return c["tmp"] / "new"


# (name, call, the error class). `c` holds the store, a path for a new store and the receiver.
HOSTILE = [
    # open_store
    ("open-nul-path", lambda c: cg.open_store("a\x00b"), UsageError),
    ("open-nul-pathlike", lambda c: cg.open_store(c["tmp"] / "a\x00b"), UsageError),
    ("open-bytes-path", lambda c: cg.open_store(b"store"), UsageError),
    ("open-list-path", lambda c: cg.open_store([str(c["store"])]), UsageError),
    ("open-surrogate-sharer", lambda c: cg.open_store(c["store"], sharer="\udcff"), UsageError),
    ("open-nul-device", lambda c: cg.open_store(c["store"], device="cpu\x00"), UsageError),
    ("open-nan-dtype", lambda c: cg.open_store(c["store"], dtype=NAN), UsageError),
    ("open-bytes-index-kind", lambda c: cg.open_store(c["store"], index_kind=b"bm25"), UsageError),
    # cg.ask (one-shot)
    ("ask-nul-store", lambda c: cg.ask(QUESTION, "a\x00b"), UsageError),
    ("ask-surrogate-question", lambda c: cg.ask("who \ud800?", c["store"]), UsageError),
    ("ask-cli-bytes-question", lambda c: cg.ask("\udcff\udcfe", c["store"]), UsageError),
    ("ask-nul-question", lambda c: cg.ask("who\x00?", c["store"]), UsageError),
    ("ask-bytes-question", lambda c: cg.ask(b"who built it?", c["store"]), UsageError),
    ("ask-top-p-nan", lambda c: cg.ask(QUESTION, c["store"], top_p=NAN), UsageError),
    ("ask-top-p-below-float", lambda c: cg.ask(QUESTION, c["store"], top_p=1e-400), UsageError),
    ("ask-k-negative", lambda c: cg.ask(QUESTION, c["store"], k=-(10**30)), UsageError),
    ("ask-max-new-tokens-inf", lambda c: cg.ask(QUESTION, c["store"], max_new_tokens=INF), UsageError),
    ("ask-seed-huge", lambda c: cg.ask(QUESTION, c["store"], seed=2**64), UsageError),
    ("ask-blend-layer-huge", lambda c: cg.ask(QUESTION, c["store"], blend=0.5, blend_layer=2**70), UsageError),
    ("ask-blend-layer-past-last", lambda c: cg.ask(QUESTION, c["store"], blend=0.5, blend_layer=4), UsageError),
    ("ask-temperature-huge-int", lambda c: cg.ask(QUESTION, c["store"], temperature=10**400), UsageError),
    # cg.ask_many
    ("many-surrogate-item", lambda c: cg.ask_many([QUESTION, "\ud800"], c["store"]), UsageError),
    ("many-bytes-item", lambda c: cg.ask_many([b"who?"], c["store"]), UsageError),
    ("many-nested-list", lambda c: cg.ask_many([[QUESTION]], c["store"]), UsageError),
    ("many-generator-nul-store", lambda c: cg.ask_many((q for q in [QUESTION]), "a\x00b"), UsageError),
    ("many-batch-nan", lambda c: cg.ask_many([QUESTION], c["store"], batch_size=NAN), UsageError),
    ("many-batch-negative", lambda c: cg.ask_many([QUESTION], c["store"], batch_size=-1), UsageError),
    ("many-bytes", lambda c: cg.ask_many(b"who?", c["store"]), UsageError),
    # cg.encode: arguments
    ("encode-nul-store", lambda c: cg.encode(PASSAGES, "a\x00b", models=_rx(c)), UsageError),
    ("encode-nul-corpus", lambda c: cg.encode("a\x00b.jsonl", _new(c), models=_rx(c)), UsageError),
    ("encode-surrogate-receiver", lambda c: cg.encode(PASSAGES, _new(c), models=cg.Models(receiver="\udcff")),
     UsageError),
    ("encode-nul-instruction", lambda c: cg.encode(PASSAGES, _new(c), models=cg.Models(receiver=c["receiver"],
                                                                                        instruction="\x00")),
     UsageError),
    ("encode-batch-nan", lambda c: cg.encode(PASSAGES, _new(c), models=_rx(c),
                                             options=cg.EncodeOptions(batch_size=NAN)),
     UsageError),
    ("encode-keep-nan", lambda c: cg.encode(PASSAGES, _new(c), models=_rx(c), options=cg.EncodeOptions(keep=NAN)),
     UsageError),
    ("encode-max-tokens-huge", lambda c: cg.encode(PASSAGES, _new(c), models=_rx(c),
                                                   options=cg.EncodeOptions(max_passage_tokens=10**30)), UsageError),
    ("encode-options-class", lambda c: cg.encode(PASSAGES, _new(c), models=_rx(c), options=cg.EncodeOptions),
     UsageError),
    # cg.encode: passages
    ("encode-surrogate-text", lambda c: cg.encode(_meta(text="x \ud800 y"), _new(c), models=_rx(c)),
     CorpusError),
    ("encode-surrogate-title", lambda c: cg.encode(_meta(title="\udcff"), _new(c), models=_rx(c)),
     CorpusError),
    ("encode-surrogate-id", lambda c: cg.encode(_meta(id="\udcff"), _new(c), models=_rx(c)), CorpusError),
    ("encode-bytes-text", lambda c: cg.encode(_meta(text=b"bytes"), _new(c), models=_rx(c)), CorpusError),
    ("encode-passage-bytes-text", lambda c: cg.encode([cg.Passage("a", "T", b"bytes")], _new(c),
                                                      models=_rx(c)), CorpusError),
    ("encode-passage-nul-id", lambda c: cg.encode([cg.Passage("a\x00b", "T", "text")], _new(c),
                                                  models=_rx(c)), CorpusError),
    ("encode-passage-list-title", lambda c: cg.encode([cg.Passage("a", ["T"], "text")], _new(c),
                                                      models=_rx(c)), CorpusError),
    ("encode-passage-list-metadata", lambda c: cg.encode([cg.Passage("a", "T", "text", [1])], _new(c),
                                                         models=_rx(c)), CorpusError),
    ("encode-list-title", lambda c: cg.encode(_meta(title=["a", "b"]), _new(c), models=_rx(c)), CorpusError),
    ("encode-dict-id", lambda c: cg.encode(_meta(id={"x": 1}), _new(c), models=_rx(c)), CorpusError),
    ("encode-set-metadata", lambda c: cg.encode(_meta(tags={1, 2}), _new(c), models=_rx(c)), CorpusError),
    ("encode-object-metadata", lambda c: cg.encode(_meta(owner=object()), _new(c), models=_rx(c)),
     CorpusError),
    ("encode-nan-metadata", lambda c: cg.encode(_meta(score=NAN), _new(c), models=_rx(c)), CorpusError),
    ("encode-inf-nested-metadata", lambda c: cg.encode(_meta(scores={"a": [1.0, -INF]}), _new(c),
                                                       models=_rx(c)), CorpusError),
    ("encode-int-key-metadata", lambda c: cg.encode([{"id": "a", "text": "x y", 3: "three"}], _new(c),
                                                    models=_rx(c)), CorpusError),
    ("encode-cyclic-metadata", lambda c: cg.encode(_meta(loop=_cycle()), _new(c), models=_rx(c)),
     CorpusError),
    ("encode-surrogate-metadata", lambda c: cg.encode(_meta(note="\ud800"), _new(c), models=_rx(c)),
     CorpusError),
    ("encode-ints-as-records", lambda c: cg.encode(iter([1, 2]), _new(c), models=_rx(c)), CorpusError),
    ("encode-strings-as-records", lambda c: cg.encode(["just text"], _new(c), models=_rx(c)), CorpusError),
    # cg.index
    ("index-nul-store", lambda c: cg.index("a\x00b"), UsageError),
    ("index-nul-embedder", lambda c: cg.index(c["store"], kind="dense", embedder="x\x00y"), UsageError),
    ("index-bytes-engine", lambda c: cg.index(c["store"], engines=[b"flat"]), UsageError),
    ("index-surrogate-engine", lambda c: cg.index(c["store"], engines=["\ud800"]), UsageError),
    ("index-nan-rebuild", lambda c: cg.index(c["store"], rebuild=NAN), UsageError),
    # Store.ask
    ("store-ask-surrogate", lambda c: cg.open_store(c["store"]).ask("\ud800"), UsageError),
    ("store-ask-bytes", lambda c: cg.open_store(c["store"]).ask(b"who?"), UsageError),
    ("store-ask-top-p-inf", lambda c: cg.open_store(c["store"]).ask(QUESTION, top_p=INF), UsageError),
    ("store-ask-blend-layer", lambda c: cg.open_store(c["store"]).ask(QUESTION, blend=1.0, blend_layer=99),
     UsageError),
    ("store-ask-bad-generation", lambda c: cg.open_store(c["store"]).ask(
        QUESTION, options=cg.AskOptions(generation=cg.GenerationOptions(top_p=-1.0))), UsageError),
    ("store-ask-on-text-str", lambda c: cg.open_store(c["store"]).ask(QUESTION, on_text="print"), UsageError),
    # Store.encode (an append: the store must be left as it was)
    ("store-encode-nan", lambda c: cg.open_store(c["store"]).encode(_meta(score=NAN)), CorpusError),
    ("store-encode-list-title", lambda c: cg.open_store(c["store"]).encode([cg.Passage("a", ["T"], "x")]),
     CorpusError),
    ("store-encode-surrogate", lambda c: cg.open_store(c["store"]).encode(_meta(text="\ud800")), CorpusError),
    ("store-encode-nul-corpus", lambda c: cg.open_store(c["store"]).encode("a\x00b.jsonl"), UsageError),
    ("store-encode-set-metadata", lambda c: cg.open_store(c["store"]).encode(_meta(tags={"x"})), CorpusError),
]


def _snapshot(root) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.fixture
def refused(store, tiny_dirs, tmp_path, monkeypatch, no_model_loads):
    """Calls `call`, returns its `CacheGraftError`; fails on a raw exception, an acceptance, a
    model load, or anything written (no new store, no ./None, the existing store untouched)."""
    monkeypatch.chdir(tmp_path)
    before = _snapshot(store)
    ctx = {"store": store, "receiver": str(tiny_dirs["receiver"]), "tmp": tmp_path}

    def call(name, fn) -> CacheGraftError:
        try:
            fn(ctx)
        except CacheGraftError as exc:
            record(api_bad_calls=1, api_raw_exceptions=0)
            assert list(tmp_path.iterdir()) == [], name  # nothing written: no store directory left
            assert _snapshot(store) == before, name
            return exc
        except BaseException as exc:
            record(api_bad_calls=1, api_raw_exceptions=1)
            raise AssertionError(f"{name}: raw {type(exc).__name__}: {exc}") from exc
        raise AssertionError(f"{name}: accepted")

    return call


@pytest.mark.parametrize("name, fn, kind", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_call_is_a_typed_error_before_anything_loads(name, fn, kind, refused):
    error = refused(name, fn)
    assert isinstance(error, kind), (name, type(error), error)
    assert error.message and error.hint, name
    assert error.exit_code == (2 if kind is UsageError else kind.exit_code)


def test_the_hostile_table_is_large_and_covers_every_entry_point():
    assert len(HOSTILE) >= 50
    for entry in ("open-", "ask-", "many-", "encode-", "index-", "store-ask-", "store-encode-"):
        assert sum(name.startswith(entry) for name, _, _ in HOSTILE) >= 3, entry


# ---------------------------------------------------------------- each case of the report, on its own


def test_a_nul_in_a_path_is_a_usage_error(refused):
    for name, fn in (("open", lambda c: cg.open_store("a\x00b")), ("ask", lambda c: cg.ask(QUESTION, "a\x00b")),
                     ("encode", lambda c: cg.encode(PASSAGES, "a\x00b", models=_rx(c)))):
        error = refused(name, fn)
        assert isinstance(error, UsageError) and "NUL" in error.message and "store" in error.message, error


def test_lone_surrogates_in_questions_and_passages_are_refused(refused):
    for name, fn in (("ask", lambda c: cg.ask("who \ud800?", c["store"])),
                     ("store.ask", lambda c: cg.open_store(c["store"]).ask("\udcff\udcfe"))):
        error = refused(name, fn)
        assert isinstance(error, UsageError) and "lone surrogate" in error.message, error
    for name, fn in (("text", lambda c: cg.encode(_meta(text="a \ud800"), _new(c), models=_rx(c))),
                     ("title", lambda c: cg.encode(_meta(title="\ud800"), _new(c), models=_rx(c))),
                     ("store.encode", lambda c: cg.open_store(c["store"]).encode(_meta(text="\udc80")))):
        error = refused(name, fn)
        assert isinstance(error, CorpusError) and "[0]: not UTF-8" in error.message, error
        assert "passage 'a'" in error.message and "lone surrogate" in error.message, error


def test_bytes_where_text_is_expected_are_refused(refused):
    error = refused("question", lambda c: cg.ask(b"who?", c["store"]))
    assert isinstance(error, UsageError) and "question must be a string" in error.message
    for fn in (lambda c: cg.encode(_meta(text=b"x"), _new(c), models=_rx(c)),
               lambda c: cg.encode([cg.Passage("a", "T", b"x")], _new(c), models=_rx(c))):
        error = refused("passage text", fn)
        assert isinstance(error, CorpusError) and "is a bytes, not a string" in error.message, error


@pytest.mark.parametrize("value, words", [({1, 2}, "'tags' is of type set"), (object(), "'tags' is of type object"),
                                          (NAN, "'tags' is nan, not a finite number"),
                                          ({"deep": [INF]}, "'tags.deep[0]' is inf"),
                                          (_cycle(), "'tags' is nested more than 32 levels")])
def test_metadata_json_cannot_hold_is_refused_before_the_store_exists(value, words, refused):
    """A set or an object used to fail after the models loaded, leaving an empty store behind;
    a NaN was written as a bare `NaN` (not JSON). Each is refused naming its key."""
    error = refused("metadata", lambda c: cg.encode(_meta(tags=value), _new(c), models=_rx(c)))
    assert isinstance(error, CorpusError) and "bad metadata" in error.message and words in error.message, error
    assert "passage 'a'" in error.message


def test_a_title_must_be_a_string(refused, tmp_path_factory):
    """A list title was stored as its repr ("['a', 'b']"), from the API and from corpus files."""
    error = refused("api", lambda c: cg.encode(_meta(title=["a", "b"]), _new(c), models=_rx(c)))
    assert isinstance(error, CorpusError)
    assert "[0]: bad title (passage 'a': field 'title' is a list, not a string)" in error.message
    corpus = tmp_path_factory.mktemp("titles") / "titles.jsonl"
    corpus.write_text(json.dumps({"id": "ok", "text": "fine"}) + "\n" +
                      json.dumps({"id": "p2", "title": ["x"], "text": "y"}) + "\n")
    error = refused("file", lambda c: cg.encode(corpus, _new(c), models=_rx(c)))
    assert isinstance(error, CorpusError) and f"{corpus}:2: bad title (passage 'p2'" in error.message, error


def test_a_blend_layer_past_the_receivers_last_is_refused_not_clamped(refused):
    """The tiny receiver has 4 layers (the store's geometry says so before any model loads)."""
    for fn in (lambda c: cg.ask(QUESTION, c["store"], blend=0.5, blend_layer=4),
               lambda c: cg.open_store(c["store"]).ask_many([QUESTION], blend=0.5, blend_layer=99)):
        error = refused("blend_layer", fn)
        assert isinstance(error, UsageError) and "must be from 0 to 3" in error.message and "4 layers" in error.message


def test_a_blend_layer_in_range_still_answers(store):
    answer = cg.open_store(store).ask("harbor lighthouse treaty Vienna", k=2, blend=0.5, blend_layer=3,
                                      max_new_tokens=2)
    assert len(answer.sources) == 2
    assert answer.tokens["recomputed"] > 0  # the blend ran, at the last layer


def test_a_top_p_that_underflows_samples_the_top_token(store, greedy_margins):
    """top_p=1e-300 is 0 in float32: the nucleus kept no token and sampling from all zeros raised
    a raw RuntimeError. The most likely token is always kept, so it samples the greedy answer."""
    from conftest import MIN_GREEDY_MARGIN

    graft = cg.open_store(store)
    greedy = graft.ask(QUESTION, k=1, max_new_tokens=4)
    for seed in (0, 1, 2):
        sampled = graft.ask(QUESTION, k=1, max_new_tokens=4, temperature=1.0, top_p=1e-300, seed=seed)
        assert sampled.text == greedy.text
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN


def test_nucleus_sampling_is_unchanged_for_usable_top_p():
    """The same draws as the nucleus without the always-kept top token, for top_p the dtype holds."""
    import torch

    from cachegraft_cli.lm.generation import pick_token
    from cachegraft_cli.lm.sampling import GenerationOptions

    def reference(logits, config, rng):  # the nucleus as it was before the fix
        probs = torch.softmax(logits / config.temperature, dim=-1)
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < config.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))

    logits = torch.randn(320, generator=torch.Generator().manual_seed(0)) * 4
    for top_p in (0.05, 0.5, 0.9, 0.999, 1e-30):
        config = GenerationOptions(temperature=0.8, top_p=top_p)
        ours = [pick_token(logits, config, torch.Generator().manual_seed(s)) for s in range(20)]
        theirs = [reference(logits, config, torch.Generator().manual_seed(s)) for s in range(20)]
        assert ours == theirs, top_p
    tiny = GenerationOptions(temperature=0.8, top_p=1e-300)
    assert pick_token(logits, tiny, torch.Generator().manual_seed(0)) == int(torch.argmax(logits))


def test_a_huge_k_is_searched_as_the_whole_store(store):
    """-k 10**30 overflowed the search engine (a raw OverflowError); -k 2**31-1 made tantivy abort
    the process sizing its buffers. No store has more passages than it holds: k is capped there."""
    from cachegraft_cli.answering.ask import Asker

    asker = Asker(store)
    assert asker.search_k(10**30) == asker.search_k(2**31 - 1) == 2 and asker.search_k(1) == 1
    assert {h.id for h in asker.retrieve("harbor lighthouse treaty", 10**30)} == {"harbor", "treaty"}


# ---------------------------------------------------------------- appends: the store's check first


def _lost_attributes(store, where):
    shutil.copytree(store, where)
    meta = json.loads((where / "zarr.json").read_text())
    meta["attributes"] = {}
    (where / "zarr.json").write_text(json.dumps(meta))
    return where


def test_an_append_to_a_store_that_lost_its_metadata_is_refused_before_any_hub_lookup(store, tmp_path, monkeypatch,
                                                                                       no_model_loads):
    """With no --receiver, the default preset's hub models were resolved (~50 s of retries online)
    before the store was found not to be one."""
    from cachegraft_cli.lm import models

    def no_hub(spec, *a, **k):
        raise AssertionError(f"model {spec!r} was looked up before the store was checked")

    monkeypatch.setattr(models, "resolve_source", no_hub)
    lost = _lost_attributes(store, tmp_path / "lost")
    before = _snapshot(lost)
    start = time.perf_counter()
    with pytest.raises(StoreError) as info:
        cg.encode([{"id": "more", "text": "Photosynthesis makes sugar."}], lost)
    assert time.perf_counter() - start < 5
    assert "is not a cache store" in info.value.message and "zarr.json" in info.value.message, info.value
    assert info.value.exit_code == 5 and info.value.hint
    assert _snapshot(lost) == before


def test_an_append_naming_another_receiver_is_refused_before_it_loads(store, tiny_dirs, no_model_loads):
    """--receiver naming another model than the store records was refused only after loading it
    (the identity check compares names and fingerprints); the names are compared first now."""
    before = _snapshot(store)
    other = str(tiny_dirs["sharer_same"])
    with pytest.raises(StoreMismatchError) as info:
        cg.encode([{"id": "more", "text": "Photosynthesis makes sugar."}], store, models=cg.Models(receiver=other))
    assert f"was encoded with receiver {tiny_dirs['receiver']}, but --receiver names {other}" in info.value.message
    assert "Leave out --receiver" in info.value.hint
    assert _snapshot(store) == before


def test_an_append_naming_the_stores_own_models_still_works(store, tiny_dirs, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    summary = cg.encode([{"id": "more", "text": "Photosynthesis makes sugar."}], copy,
                        models=cg.Models(receiver=str(tiny_dirs["receiver"]), fuser="none"))
    assert summary.added == 1


def test_stdin_corpus_with_lone_surrogate_escapes_names_the_line(tiny_dirs, tmp_path, monkeypatch, no_model_loads):
    import io

    lines = [json.dumps({"id": "a", "text": "fine"}), '{"id": "b", "text": "bad \\ud800 escape"}']
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    with pytest.raises(CorpusError) as info:
        cg.encode("-", tmp_path / "s", models=cg.Models(receiver=str(tiny_dirs["receiver"])))
    assert info.value.message.startswith("<stdin>:2: not UTF-8 (passage 'b'"), info.value
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("name, content, where", [
    ("c.jsonl", '{"id": "a", "text": "fine"}\n{"id": "b", "title": "\\udfff", "text": "x"}\n', "c.jsonl:2: not UTF-8"),
    ("c.json", '[{"id": "a", "text": "fine"}, {"id": "b", "text": "\\ud800"}]', "c.json: [1]: not UTF-8"),
    ("squad.json", json.dumps({"data": [{"title": "T", "paragraphs": [{"context": "x"}]}]}).replace('"x"', '"\\ud800"'),
     "squad.json: data[0].paragraphs[0]: not UTF-8"),
])
def test_corpus_files_with_lone_surrogate_escapes_name_the_record(name, content, where, tmp_path):
    """Valid UTF-8 files whose JSON escapes decode to a lone surrogate: refused while the corpus is
    read (before any model loads), naming the file and line or record; --skip-bad counts them."""
    from cachegraft_cli.corpus import read_corpus

    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(CorpusError) as info:
        read_corpus(path).validate()
    assert info.value.message.startswith(f"{tmp_path}/{where}") and "lone surrogate" in info.value.message
    skipping = read_corpus(path, skip_bad=True)
    skipping.validate()
    assert skipping.skipped["not UTF-8"] == 1
