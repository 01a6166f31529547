"""The Python API as a user calls it: `import cachegraft_cli as cg` (tiny models)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from conftest import MIN_GREEDY_MARGIN

import cachegraft_cli as cg
from cachegraft_cli.errors import NoPassagesError, StoreNotFoundError, UsageError

PASSAGES = [
    {
        "id": "harbor",
        "title": "Harbor town",
        "text": "Harbor town was founded in 1820 by fishermen who built the first lighthouse.",
    },
    {
        "id": "treaty",
        "title": "Treaty",
        "text": "The treaty was signed in Vienna after long talks between the two empires.",
    },
]
MORE = cg.Passage("photo", "Photosynthesis", "Photosynthesis turns light, water and carbon dioxide into sugar and "
                                             "oxygen.")


@pytest.fixture
def store(tiny_dirs, tmp_path):
    path = tmp_path / "store"
    summary = cg.encode(PASSAGES, path, models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"),
                        options=cg.EncodeOptions(codec="float32"))
    assert summary.added == 2 and summary.fuser == "closed"
    cg.index(path)
    return path


def test_import_is_light_and_lists_the_api():
    code = (
        "import sys, cachegraft_cli as cg; assert 'torch' not in sys.modules and 'cachegraft_cli.api' not in "
        "sys.modules; "
        "print(sorted(n for n in cg.__all__ if not n.startswith('_')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "open_store" in proc.stdout and "Models" in proc.stdout and "CorpusSource" in proc.stdout
    assert "encode_passages" not in proc.stdout and "answer_many" not in proc.stdout  # the 0.1 names are gone


def test_store_keeps_its_models_across_questions(store, loads, greedy_margins):
    graft = cg.open_store(store)
    one = graft.ask("who built the lighthouse?", k=1, max_new_tokens=4)
    assert isinstance(one, cg.Answer) and one.sources[0].id == "harbor" and one.system == "graft"
    assert str(one) == one.text and one.as_dict()["answer"] == one.text and one.tokens["generated"] > 0
    many = graft.ask_many(["who built the lighthouse?", "where was the treaty signed?"], k=1, max_new_tokens=4,
                          batch_size=2)
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # batch vs single: equal up to rounding, decided on every CPU
    assert [a.text for a in many][0] == one.text and many[1].sources[0].id == "treaty"
    text = graft.ask("who built the lighthouse?", k=1, max_new_tokens=4, system="text")
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # cache vs text (other shapes): the same
    assert text.text == one.text  # closed fuser, k=1: the cache answer is the text answer
    assert loads == [loads[0]]  # one receiver load for every question and system


def test_append_and_reindex_through_the_handle(store, loads):
    graft = cg.open_store(store)
    graft.warm()
    summary = graft.encode([MORE])  # the store's own models: no model option given
    assert summary.added == 1 and summary.skipped_existing == 0
    assert graft.index()["added"] == 1
    answer = graft.ask("what does photosynthesis make?", k=1, max_new_tokens=2)
    assert answer.sources[0].id == "photo"
    assert len(loads) == 2  # the handle's receiver, plus the one encode loaded; asking after reloads nothing


def test_one_shot_calls_and_their_errors(store, tmp_path):
    answer = cg.ask("where was the treaty signed?", store, k=1, max_new_tokens=3, dtype="float32")
    assert answer.sources[0].id == "treaty"
    assert [a.sources[0].id for a in cg.ask_many(["who built the lighthouse?"], store, k=1, max_new_tokens=2)] == \
        ["harbor"]
    with pytest.raises(UsageError, match="Unknown ask option"):
        cg.ask("q?", store, top_k=3)
    with pytest.raises(UsageError, match="Unknown system"):
        cg.ask("q?", store, system="nope")
    with pytest.raises(NoPassagesError):
        cg.ask("zzqx vvbnm", store)
    with pytest.raises(StoreNotFoundError):
        cg.open_store(tmp_path / "missing")
    assert cg.ask_options(k=5, seed=1).generation.seed == 1


def test_passages_from_dicts_are_checked(tiny_dirs, tmp_path):
    from cachegraft_cli.errors import CorpusError

    with pytest.raises(CorpusError, match=r"\[0\]: missing text"):
        cg.encode([{"id": "x", "title": "no text"}], tmp_path / "s",
                  models=cg.Models(receiver=str(tiny_dirs["receiver"])))
    assert not (tmp_path / "s").exists()  # refused before anything was written


# ---------------------------------------------------------------- bad calls
# Every argument of `encode`, `open_store`, `Store.ask`, `Store.ask_many` (and the one-shot forms)
# given a wrong type or value: a UsageError (exit code 2) with a hint naming the
# argument, before any model loads and before anything is written.

GOOD = [{"id": "a", "text": "Harbor town was founded in 1820."}]
NAN, INF = float("nan"), float("inf")


_GROUPS = {"models": ("preset", "receiver", "sharer", "fuser", "device", "dtype", "trust_remote_code", "instruction"),
           "options": tuple(f.name for f in dataclasses.fields(cg.EncodeOptions)),
           "source": ("format", "id_field", "text_field", "title_field", "skip_bad")}


def _enc(**kw):
    """`cg.encode` with the settings given one by one, each put in its object (made inside the call,
    so a bad field is refused as the call is)."""
    def call(c):
        args = {"corpus": GOOD, "store": c["tmp"] / "new", **({} if "models" in kw else {"receiver": c["receiver"]}),
                **kw}
        corpus, store = args.pop("corpus"), args.pop("store")
        made = {"models": cg.Models, "options": cg.EncodeOptions, "source": cg.CorpusSource}
        for group, names in _GROUPS.items():
            fields = {n: args.pop(n) for n in names if n in args}
            if fields:
                args[group] = made[group](**fields)
        return cg.encode(corpus, store, **args)
    return call


def _open(**kw):
    return lambda c: cg.open_store(kw.pop("path", c["store"]), **kw)


def _ask(question="who built the lighthouse?", **kw):
    return lambda c: cg.open_store(c["store"]).ask(question, **kw)


def _many(questions=("who built the lighthouse?",), **kw):
    return lambda c: cg.open_store(c["store"]).ask_many(questions, **kw)


BAD_CALLS = [
    # encode: every argument
    ("encode-corpus-none", _enc(corpus=None), "corpus"),
    ("encode-corpus-int", _enc(corpus=3), "corpus"),
    ("encode-corpus-dict", _enc(corpus={"id": "a", "text": "x"}), "corpus"),
    ("encode-corpus-bytes", _enc(corpus=b"corpus.jsonl"), "corpus"),
    ("encode-corpus-empty-path", _enc(corpus=""), "corpus"),
    ("encode-store-none", _enc(store=None), "store"),
    ("encode-store-int", _enc(store=3), "store"),
    ("encode-store-empty", _enc(store=" "), "store"),
    ("encode-preset-int", _enc(preset=3), "preset"),
    ("encode-preset-unknown", _enc(preset="nope", receiver=None), "preset"),
    ("encode-receiver-int", _enc(receiver=3), "receiver"),
    ("encode-receiver-empty", _enc(receiver=""), "receiver"),
    ("encode-sharer-list", _enc(sharer=["x"]), "sharer"),
    ("encode-fuser-int", _enc(fuser=1), "fuser"),
    ("encode-options-dict", _enc(options={"batch_size": 8}), "options"),
    ("encode-codec-unknown", _enc(codec="int5"), "codec"),
    ("encode-codec-int", _enc(codec=8), "codec"),
    ("encode-batch-size-str", _enc(batch_size="8"), "batch_size"),
    ("encode-batch-size-zero", _enc(batch_size=0), "batch_size"),
    ("encode-batch-size-float", _enc(batch_size=1.5), "batch_size"),
    ("encode-batch-size-bool", _enc(batch_size=True), "batch_size"),
    ("encode-batch-size-huge", _enc(batch_size=10**9), "batch_size"),
    ("encode-max-passage-tokens-small", _enc(max_passage_tokens=3), "max_passage_tokens"),
    ("encode-max-passage-tokens-str", _enc(max_passage_tokens="512"), "max_passage_tokens"),
    ("encode-also-own-cache-str", _enc(also_own_cache="yes"), "also_own_cache"),
    ("encode-commit-every-zero", _enc(commit_every=0), "commit_every"),
    ("encode-keep-zero", _enc(keep=0), "keep"),
    ("encode-keep-str", _enc(keep="half"), "keep"),
    ("encode-keep-above-one", _enc(keep=1.5), "keep"),
    ("encode-compressor", _enc(compressor="gzip"), "compressor"),
    ("encode-mismatched-sharer-str", _enc(mismatched_sharer="yes"), "mismatched_sharer"),
    ("encode-sharer-notes-negative", _enc(sharer_notes=-2), "sharer_notes"),
    ("encode-calibration-empty", _enc(calibration=""), "calibration"),
    ("encode-calibration-int", _enc(calibration=5), "calibration"),
    ("encode-device-int", _enc(device=0), "device"),
    ("encode-device-bogus", _enc(device="gpu0"), "device"),
    ("encode-dtype-int", _enc(dtype=16), "dtype"),
    ("encode-dtype-unknown", _enc(dtype="int8"), "dtype"),
    ("encode-trust-remote-code-str", _enc(trust_remote_code="no"), "trust_remote_code"),
    ("encode-instruction-int", _enc(instruction=3), "instruction"),
    ("encode-skip-bad-str", _enc(skip_bad="no"), "skip_bad"),
    ("encode-format-int", _enc(format=3), "format"),
    ("encode-id-field-none", _enc(id_field=None), "id_field"),
    ("encode-text-field-empty", _enc(text_field=""), "text_field"),
    ("encode-title-field-int", _enc(title_field=1), "title_field"),
    ("encode-runner-unknown", _enc(runner="spark"), "runner"),
    ("encode-runner-object", _enc(runner=object()), "runner"),
    ("encode-models-dict", _enc(models={"receiver": "x"}), "models"),
    ("encode-source-dict", _enc(source={"format": "jsonl"}), "source"),
    ("encode-progress-int", _enc(progress=3), "progress"),
    ("encode-planned-str", _enc(planned="x"), "planned"),
    # open_store: every argument
    ("open-path-none", _open(path=None), "store"),
    ("open-path-int", _open(path=3), "store"),
    ("open-path-empty", _open(path=""), "store"),
    ("open-sharer-int", _open(sharer=3), "sharer"),
    ("open-device-int", _open(device=3), "device"),
    ("open-device-bogus", _open(device="cuda:7"), "device"),
    ("open-dtype-int", _open(dtype=3), "dtype"),
    ("open-dtype-unknown", _open(dtype="int8"), "dtype"),
    ("open-index-kind-unknown", _open(index_kind="bogus"), "index_kind"),
    ("open-index-kind-int", _open(index_kind=1), "index_kind"),
    ("open-trust-remote-code-str", _open(trust_remote_code="yes"), "trust_remote_code"),
    ("open-weights-int", _open(weights=3), "weights"),
    ("open-weights-unknown", _open(weights="int3"), "weights"),
    # Store.ask: every argument
    ("ask-question-none", _ask(None), "question"),
    ("ask-question-int", _ask(3), "question"),
    ("ask-question-empty", _ask(""), "question is empty"),
    ("ask-question-blank", _ask("   "), "question is empty"),
    ("ask-question-list", _ask(["who?"]), "question"),
    ("ask-options-dict", _ask(options={"k": 3}), "options"),
    ("ask-options-str", _ask(options="graft"), "options"),
    ("ask-options-bad-k", _ask(options=cg.AskOptions(k="3")), "k (-k)"),
    ("ask-options-bad-generation", _ask(options=cg.AskOptions(generation={"max_new_tokens": 3})), "generation"),
    ("ask-unknown-option", _ask(top_k=3), "Unknown ask option"),
    ("ask-on-text-int", _ask(on_text=3), "on_text"),
    ("ask-system-none", _ask(system=None), "system"),
    ("ask-system-unknown", _ask(system="oracle"), "system"),
    ("ask-k-str", _ask(k="3"), "k (-k)"),
    ("ask-k-float", _ask(k=1.5), "k (-k)"),
    ("ask-k-bool", _ask(k=True), "k (-k)"),
    ("ask-k-zero", _ask(k=0), "k (-k)"),
    ("ask-k-none", _ask(k=None), "k (-k)"),
    ("ask-scheme-int", _ask(scheme=3), "position scheme"),
    ("ask-order-list", _ask(order=[]), "passage order"),
    ("ask-recompute-str", _ask(recompute="a"), "recompute"),
    ("ask-recompute-negative", _ask(recompute=-1), "recompute"),
    ("ask-blend-str", _ask(blend="a"), "blend"),
    ("ask-blend-above-one", _ask(blend=2), "blend"),
    ("ask-blend-nan", _ask(blend=NAN), "blend"),
    ("ask-blend-layer-none", _ask(blend_layer=None), "blend_layer"),
    ("ask-blend-layer-negative", _ask(blend_layer=-1), "blend_layer"),
    ("ask-max-new-tokens-zero", _ask(max_new_tokens=0), "max_new_tokens"),
    ("ask-max-new-tokens-str", _ask(max_new_tokens="48"), "max_new_tokens"),
    ("ask-max-new-tokens-float", _ask(max_new_tokens=1.5), "max_new_tokens"),
    ("ask-max-new-tokens-window", _ask(max_new_tokens=100_000), "context window of 512"),
    ("ask-temperature-negative", _ask(temperature=-1), "temperature"),
    ("ask-temperature-str", _ask(temperature="hot"), "temperature"),
    ("ask-temperature-nan", _ask(temperature=NAN), "temperature"),
    ("ask-temperature-inf", _ask(temperature=INF), "temperature"),
    ("ask-temperature-tiny", _ask(temperature=1e-9), "temperature"),
    ("ask-top-p-two", _ask(top_p=2), "top_p"),
    ("ask-top-p-zero", _ask(top_p=0), "top_p"),
    ("ask-top-p-negative", _ask(top_p=-0.5), "top_p"),
    ("ask-top-p-str", _ask(top_p="x"), "top_p"),
    ("ask-seed-str", _ask(seed="x"), "seed"),
    ("ask-seed-negative", _ask(seed=-1), "seed"),
    ("ask-seed-float", _ask(seed=1.5), "seed"),
    ("ask-draft-tokens-negative", _ask(draft_tokens=-1), "draft_tokens"),
    ("ask-draft-tokens-eight", _ask(draft_tokens=8), "draft_tokens"),
    ("ask-draft-tokens-str", _ask(draft_tokens="7"), "draft_tokens"),
    # Store.ask_many: every argument
    ("many-string", _many("abc"), "questions must be a list"),
    ("many-none", _many(None), "questions must be a list"),
    ("many-dict", _many({"who?": 1}), "questions must be a list"),
    ("many-int", _many(42), "questions must be a list"),
    ("many-item-none", _many([None]), "questions[0]"),
    ("many-item-int", _many(["who?", 3]), "questions[1]"),
    ("many-item-empty", _many(["who?", ""]), "question"),
    ("many-options-dict", _many(options={"k": 3}), "options"),
    ("many-unknown-option", _many(top_k=3), "Unknown ask option"),
    ("many-k-zero", _many(k=0), "k (-k)"),
    ("many-top-p-two", _many(top_p=2), "top_p"),
    ("many-batch-size-str", _many(batch_size="8"), "batch_size"),
    ("many-batch-size-zero", _many(batch_size=0), "batch_size"),
    ("many-batch-size-float", _many(batch_size=1.5), "batch_size"),
    ("many-batch-size-bool", _many(batch_size=True), "batch_size"),
    ("many-batch-size-none", _many(batch_size=None), "batch_size"),
    ("many-batch-size-huge", _many(batch_size=5000), "batch_size"),
    ("many-max-new-tokens-window", _many(max_new_tokens=100_000), "context window of 512"),
    # one-shot and deprecated forms, and index
    ("oneshot-ask-store-none", lambda c: cg.ask("who?", None), "store"),
    ("oneshot-ask-question-none", lambda c: cg.ask(None, c["store"]), "question"),
    ("oneshot-ask-seed-str", lambda c: cg.ask("who?", c["store"], seed="x"), "seed"),
    ("oneshot-many-string", lambda c: cg.ask_many("abc", c["store"]), "questions must be a list"),
    ("oneshot-many-batch-zero", lambda c: cg.ask_many(["who?"], c["store"], batch_size=0), "batch_size"),
    ("index-store-none", lambda c: cg.index(None), "store"),
    ("index-kind-int", lambda c: cg.index(c["store"], kind=3), "index kind"),
    ("index-engines-string", lambda c: cg.index(c["store"], engines="flat"), "engines"),
    ("index-rebuild-str", lambda c: cg.index(c["store"], rebuild="yes"), "rebuild"),
    ("handle-encode-options-dict", lambda c: cg.open_store(c["store"]).encode(GOOD, options={}), "options"),
]


@pytest.fixture(scope="module")
def asked_store(tiny_dirs, tmp_path_factory):
    path = tmp_path_factory.mktemp("api-bad") / "store"
    cg.encode(PASSAGES, path, models=cg.Models(receiver=str(tiny_dirs["receiver"]), dtype="float32"))
    cg.index(path)
    return path


def _snapshot(root) -> dict:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("name, call, words", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_api_call_is_a_usage_error_before_anything_loads(name, call, words, asked_store, tiny_dirs, tmp_path,
                                                             monkeypatch, no_model_loads):
    from faults import record

    from cachegraft_cli.errors import CacheGraftError

    monkeypatch.chdir(tmp_path)  # a store named "None" or "3" would appear here
    before = _snapshot(asked_store)
    ctx = {"store": asked_store, "receiver": str(tiny_dirs["receiver"]), "tmp": tmp_path}
    try:
        call(ctx)
    except CacheGraftError as exc:
        error: BaseException = exc
    except BaseException as exc:
        record(api_bad_calls=1, api_raw_exceptions=1)
        raise AssertionError(f"{name}: raw {type(exc).__name__}: {exc}") from exc
    else:
        raise AssertionError(f"{name}: accepted")
    record(api_bad_calls=1, api_raw_exceptions=0)
    assert isinstance(error, UsageError) and error.exit_code == 2, (type(error), error)
    assert words in error.message and error.hint, (error.message, error.hint)
    assert list(tmp_path.iterdir()) == []  # nothing written: no store, no lock, no ./None
    assert _snapshot(asked_store) == before


def test_bad_calls_cover_every_argument():
    """Each parameter of encode, open_store, Store.ask and Store.ask_many has a bad call above."""
    import inspect

    names = " ".join(c[0] for c in BAD_CALLS)
    covered = {"encode": (cg.encode, "encode-"), "open_store": (cg.open_store, "open-"),
               "ask": (cg.Store.ask, "ask-"), "ask_many": (cg.Store.ask_many, "many-")}
    spelled = {"questions": "", "settings": "unknown-option"}  # ask_many's questions: many-string, many-item-...
    for label, (fn, prefix) in covered.items():
        for param in [p for p in inspect.signature(fn).parameters if p != "self"]:
            assert f"{prefix}{spelled.get(param, param.replace('_', '-'))}" in names, (label, param)
    ask_settings = list(cg.AskSettings.__annotations__)
    for setting in ask_settings:
        assert f"ask-{setting.replace('_', '-')}" in names, setting
    assert len(BAD_CALLS) >= 100
