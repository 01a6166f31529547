"""Retrieval index: BM25 always; dense/hybrid with a tiny local random model and,
with the real MiniLM when $CACHEGRAFT_TEST_EMBEDDER names its directory or it was pulled
(`cachegraft models pull all-minilm-l6-v2`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from real_models import real_model, reason

from cachegraft_cli.corpus import read_corpus
from cachegraft_cli.errors import (
    IndexMismatchError,
    IndexMissingError,
    ModelLoadError,
    NoPassagesError,
    RetrievalIndexError,
)
from cachegraft_cli.retrieval.index import (
    Doc,
    Hit,
    _Embedder,
    build_index,
    doc_hash,
    load_embedder,
    load_index,
    passage_fingerprint,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from paths import SAMPLE_DATA

SAMPLE = SAMPLE_DATA
EMBEDDER = real_model("CACHEGRAFT_TEST_EMBEDDER", "all-minilm-l6-v2")


@pytest.fixture(scope="module")
def docs():
    return list(read_corpus(SAMPLE / "corpus.jsonl"))


@pytest.fixture(scope="module")
def questions():
    lines = (SAMPLE / "questions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def bm25(docs):
    return build_index(docs, "bm25", stem=False)


def top_ids(index, queries, k=1):
    return [[h.id for h in hits] for hits in index.search_many(queries, k)]


# ---------------------------------------------------------------- BM25


def test_bm25_finds_the_gold_passage(bm25, questions):
    got = top_ids(bm25, [q["question"] for q in questions])
    assert got == [q["gold_ids"][:1] for q in questions]


def test_bm25_hits_are_sorted_and_skip_nonmatching(bm25):
    hits = bm25.search("Harrowmere lake", k=50)
    assert all(isinstance(h, Hit) for h in hits) and 0 < len(hits) < 24
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert bm25.search("zzzz qqqq", k=5) == [] and bm25.search("the of and", k=5) == []


def test_save_load_round_trip(bm25, questions, tmp_path):
    bm25.save(tmp_path / "index")
    loaded = load_index(tmp_path / "index")
    queries = [q["question"] for q in questions]
    assert loaded.search_many(queries, 5) == bm25.search_many(queries, 5)
    assert loaded.fingerprint == bm25.fingerprint and loaded.ids == bm25.ids


def test_save_load_fsspec_url(bm25, docs, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGRAFT_HOME", str(tmp_path / "home"))
    bm25.save("memory://stores/s1/index")
    loaded = load_index("memory://stores/s1/index")
    assert loaded.search("Tamsin Bridge engineer", 2) == bm25.search("Tamsin Bridge engineer", 2)
    assert loaded.add([Doc("new", "A zeppelin hangar on the moor.")]) == 1
    loaded.save("memory://stores/s1/index")
    import fsspec

    fs = fsspec.filesystem("memory")
    fetched = []
    real_get = type(fs).get_file
    monkeypatch.setattr(type(fs), "get_file", lambda self, a, b, **kw: fetched.append(a) or real_get(self, a, b, **kw))
    again = load_index("memory://stores/s1/index")
    assert again.search("zeppelin hangar", 1)[0].id == "new" and len(again) == len(docs) + 1
    unchanged = [p for p in fetched if not p.endswith((".json", "passages.bin"))]
    assert len(unchanged) < len(fetched) / 2 + 8  # the mirror fetches new segment files and manifests only


def test_fingerprint_is_order_free_and_content_sensitive(docs):
    pairs = [(d.id, doc_hash(d)) for d in docs]
    assert passage_fingerprint(pairs) == passage_fingerprint(reversed(pairs))
    assert passage_fingerprint(pairs) != passage_fingerprint(pairs[:-1] + [(pairs[-1][0], "x")])


def test_caller_content_hash_is_used(docs):
    index = build_index([Doc(d.id, d.text, d.title, content_hash=f"h{i}") for i, d in enumerate(docs)], stem=False)
    index.check(passage_fingerprint((d.id, f"h{i}") for i, d in enumerate(docs)), len(docs))


def test_fingerprint_mismatch_refused(bm25, docs):
    bm25.check(bm25.fingerprint, len(docs))
    other = passage_fingerprint([("x", "y")])
    with pytest.raises(IndexMismatchError) as info:
        bm25.check(other, 1, store="/data/store")
    message = info.value.message
    assert "built for 24 passages" in message and "store has 1 passages" in message
    assert bm25.fingerprint[:12] in message and other[:12] in message
    assert info.value.hint == "Run `cachegraft index --store /data/store` to rebuild it."


def test_missing_index_refused(tmp_path):
    with pytest.raises(IndexMissingError) as info:
        load_index(tmp_path / "store" / "index")
    assert "cachegraft index --store" in info.value.hint and str(tmp_path / "store") in info.value.hint


def test_partly_written_index_refused(bm25, tmp_path):
    bm25.save(tmp_path / "index")
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    meta["passages"] -= 1  # index.json from one save, passages.bin from another
    (tmp_path / "index" / "index.json").write_text(json.dumps(meta))
    with pytest.raises(RetrievalIndexError, match="disagree"):
        load_index(tmp_path / "index")


def test_incremental_add(docs, tmp_path):
    index = build_index(docs[:20], "bm25", stem=False)
    index.save(tmp_path / "index")
    index = load_index(tmp_path / "index")
    assert index.add(docs[18:]) == 4  # two already there, unchanged
    full = build_index(docs, "bm25", stem=False)
    assert index.fingerprint == full.fingerprint
    assert index.search_many(["waggle dance", "octopus neurons"], 3) == full.search_many(
        ["waggle dance", "octopus neurons"], 3)
    changed = Doc(docs[0].id, "A passage now about quasar astronomy.", "Changed")
    assert index.add([changed]) == 1 and index.search("quasar", 1)[0].id == docs[0].id
    assert index.search("Odile Varran peat", 3)[0].id != docs[0].id


def test_changes_go_to_a_work_copy_until_saved(docs, tmp_path):
    build_index(docs[:10], "bm25", stem=False).save(tmp_path / "index")
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "index").rglob("*") if p.is_file()}
    index = load_index(tmp_path / "index")
    assert index.add(docs[10:]) == 14
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "index").rglob("*") if p.is_file()}
    assert after == before  # readers of the saved directory see the old index, whole
    assert len(load_index(tmp_path / "index")) == 10
    index.save(tmp_path / "index")
    assert len(load_index(tmp_path / "index")) == 24
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cachegraft-index-work")]  # work copy gone


def test_a_format_1_index_is_refused_with_a_rebuild_hint(tmp_path):
    root = tmp_path / "store" / "index"
    root.mkdir(parents=True)
    (root / "index.json").write_text(json.dumps({"format": "cachegraft-retrieval-index", "version": 1, "kind": "bm25"}))
    with pytest.raises(RetrievalIndexError, match="format 1 retrieval index") as info:
        load_index(str(root))
    assert info.value.hint == f"Run `cachegraft index --store {tmp_path / 'store'}` to rebuild it."


def test_bad_build_inputs(docs):
    with pytest.raises(NoPassagesError):
        build_index([])
    with pytest.raises(RetrievalIndexError, match="unknown index kind"):
        build_index(docs, "sparse")
    with pytest.raises(RetrievalIndexError, match="unknown retrieval engine 'lucene'"):
        build_index(docs, "bm25", engines=["lucene"])
    with pytest.raises(RetrievalIndexError, match="engine 'flat' searches vectors, which a bm25 index"):
        build_index(docs, "bm25", engines=["flat"])
    with pytest.raises(RetrievalIndexError, match="twice with different content"):
        build_index([Doc("a", "one"), Doc("a", "two")])
    with pytest.raises(RetrievalIndexError, match="cannot be searched as 'dense'"):
        build_index(docs, stem=False).view("dense")


def test_import_is_light():
    code = ("import sys, cachegraft_cli.retrieval.index, cachegraft_cli.corpus, cachegraft_cli.retrieval.engines; "
            "print([m for m in ('torch', 'bm25s', 'sentence_transformers', 'tantivy', 'usearch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- dense


@pytest.fixture(scope="module")
def tiny_embedder(tmp_path_factory, docs):
    """A 1-layer random BERT with a word-level vocabulary from the sample corpus."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("tiny-bert")
    words = sorted({w for d in docs for w in re.findall(r"\w+|[^\w\s]", f"{d.title} {d.text}".lower())})
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    tokenizer = transformers.BertTokenizer(vocab=vocab)
    assert tokenizer("harrowmere bridge")["input_ids"][1:-1] == [vocab["harrowmere"], vocab["bridge"]]
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=256)
    transformers.BertModel(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


@pytest.mark.parametrize("engine", ["usearch", "flat"])
def test_dense_tiny_model(docs, tiny_embedder, tmp_path, monkeypatch, engine):
    index = build_index(docs[:20], "dense", embedder=tiny_embedder, progress=False, engines=[engine])
    assert index.engines == {"vectors": engine}
    exact = f"{docs[3].title}\n{docs[3].text}"
    assert index.search(exact, 1)[0].id == docs[3].id
    assert index.search(exact, 1)[0].score == pytest.approx(1.0, abs=1e-4 if engine == "flat" else 2e-2)
    index.save(tmp_path / "index")
    meta = json.loads((tmp_path / "index" / "index.json").read_text())
    assert meta["dim"] == 32 and meta["engines"]["vectors"]["name"] == engine
    loaded = load_index(tmp_path / "index")
    assert loaded.embedder == tiny_embedder and loaded.search(exact, 3) == index.search(exact, 3)
    encoded = []
    original = _Embedder.encode
    monkeypatch.setattr(_Embedder, "encode",
                        lambda self, texts, query: encoded.append(len(texts)) or original(self, texts, query))
    assert loaded.add(docs) == 4 and encoded == [4]  # only the new docs are embedded
    assert loaded.search(f"{docs[22].title}\n{docs[22].text}", 1)[0].id == docs[22].id


def test_hybrid_tiny_model_fuses_ranks(docs, tiny_embedder):
    index = build_index(docs, "hybrid", embedder=tiny_embedder, stem=False, progress=False)
    query = "Tamsin Bridge granite arches"
    expected: dict[str, float] = {}
    for part in ("bm25", "dense"):
        for rank, hit in enumerate(index.view(part).search(query, 100), 1):
            expected[hit.id] = expected.get(hit.id, 0.0) + 1 / (60 + rank)
    hits = index.search(query, 5)
    assert [h.score for h in hits] == pytest.approx(sorted(expected.values(), reverse=True)[:5])
    assert all(h.score == pytest.approx(expected[h.id]) for h in hits)


def test_embedder_errors(docs, tiny_embedder, tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load the embedding model"):
        load_embedder(str(tmp_path / "no-such-model"))
    index = build_index(docs[:3], "dense", embedder=tiny_embedder, progress=False)
    index.save(tmp_path / "index")
    other = tmp_path / "wider"
    config = json.loads((Path(tiny_embedder) / "config.json").read_text())
    import transformers

    transformers.BertModel(transformers.BertConfig(**{**config, "hidden_size": 16})).save_pretrained(other)
    transformers.BertTokenizer.from_pretrained(tiny_embedder).save_pretrained(other)
    with pytest.raises(RetrievalIndexError, match="16-dim vectors, the index holds 32-dim"):
        load_index(tmp_path / "index", embedder=str(other)).search("bridge", 1)


needs_minilm = pytest.mark.skipif(not EMBEDDER, reason=reason("CACHEGRAFT_TEST_EMBEDDER", "all-minilm-l6-v2"))


@pytest.fixture(scope="module")
def minilm_hybrid(docs):
    return build_index(docs, "hybrid", embedder=EMBEDDER, stem=False, progress=False)


@needs_minilm
@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_real_embedder_finds_gold(minilm_hybrid, questions, kind):
    index = minilm_hybrid.view(kind)
    got = top_ids(index, [q["question"] for q in questions], k=3)
    found = sum(q["gold_ids"][0] in ids for q, ids in zip(questions, got))
    assert found == len(questions)
    paraphrase = index.search("a festival where people row boats with lights at night", 1)
    assert paraphrase[0].id == "harrowmere-festival"
