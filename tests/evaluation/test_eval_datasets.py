import json
from pathlib import Path

import pytest
from paths import SHARED_QA

from cachegraft_cli.errors import DatasetError, UsageError
from cachegraft_cli.evaluation.datasets import (
    load_benchmark,
    parse_dataset_spec,
    read_corpus_jsonl,
    sample_questions,
    squad_passage_id,
)


def _squad(path: Path) -> Path:
    data = {"data": [
        {"title": "Harbor_Town", "paragraphs": [
            {"context": "Harbor town was founded in 1820.", "qas": [
                {"id": "h1", "question": "When was Harbor town founded?", "answers": [{"text": "1820"}]}]},
            {"context": "Fishermen built the lighthouse.", "qas": [
                {"id": "h2", "question": "Who built the lighthouse?", "answers": [{"text": "Fishermen"}]}]}]},
        {"title": "Vienna", "paragraphs": [
            {"context": "The treaty was signed in Vienna.", "qas": [
                {"id": "v1", "question": "Where was the treaty signed?", "answers": [{"text": "Vienna"}]}]}]},
        {"title": "harbor town", "paragraphs": [{"context": "A second article, same slug.", "qas": []}]},
    ]}
    path.write_text(json.dumps(data))
    return path


def test_squad_passage_ids_and_articles_corpus(tmp_path):
    bench = load_benchmark(str(_squad(tmp_path / "tiny.json")))
    assert bench.name == "tiny"
    assert [q.id for q in bench.questions] == ["h1", "h2", "v1"]
    assert bench.questions[1].gold_ids == ["harbor-town/1"] == [squad_passage_id("Harbor_Town", 1)]
    assert bench.questions[1].title == "Harbor Town"
    # all three questions sampled: articles mode covers the articles they come from only
    assert [p.id for p in bench.passages] == ["harbor-town/0", "harbor-town/1", "vienna/0"]
    full = load_benchmark(str(tmp_path / "tiny.json"), corpus="full")
    assert full.passages[-1].id == "harbor-town~2/0"
    one = load_benchmark(f"t={tmp_path / 'tiny.json'}", limit=1, seed=0)
    assert one.name == "t" and len(one.questions) == 1
    assert {p.title for p in one.passages} == {one.questions[0].title}


def test_sampling_is_seeded_and_ordered():
    from cachegraft_cli.evaluation.datasets import QAExample

    qs = [QAExample(str(i), "q", ["a"]) for i in range(50)]
    a, b = sample_questions(qs, 10, seed=3), sample_questions(qs, 10, seed=3)
    assert a == b and [int(q.id) for q in a] == sorted(int(q.id) for q in a)
    assert sample_questions(qs, 10, seed=4) != a
    assert sample_questions(qs, None, 0) == qs


@pytest.mark.skipif(not (SHARED_QA / "squad_v1.1_dev.json").exists(), reason="shared QA data absent")
def test_shared_squad_dev_sample():
    bench = load_benchmark(str(SHARED_QA / "squad_v1.1_dev.json"), limit=5, seed=0)
    assert len(bench.questions) == 5
    ids = {p.id for p in bench.passages}
    assert all(set(q.gold_ids) <= ids for q in bench.questions)
    assert all("/" in p.id and p.text for p in bench.passages)


def test_jsonl_questions_with_contexts_and_separate_corpus(tmp_path):
    rows = [
        {"id": "a", "question": "Q1?", "answers": ["x"], "context": "ctx one", "title": "T"},
        {"id": "b", "question": "Q2?", "answers": "y", "context": "ctx two", "title": "T"},
        {"id": "c", "question": "Q3?", "answers": ["z"], "context": "ctx one", "title": "T"},
        {"id": "d", "question": "Q4?", "answers": ["w"], "gold_ids": ["p9"]},
    ]
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "p9", "contents": '"Other"\nbody nine'}) + "\n")
    bench = load_benchmark(f"{qa}?corpus={corpus}", corpus="full")
    by_id = {q.id: q for q in bench.questions}
    assert by_id["a"].gold_ids == by_id["c"].gold_ids == ["t/0"]
    assert by_id["b"].answers == ["y"] and by_id["b"].gold_ids == ["t/1"]
    assert {p.id for p in bench.passages} == {"p9", "t/0", "t/1"}
    assert read_corpus_jsonl(str(corpus))[0].title == "Other"


def test_bad_inputs(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "question": "q", "answers": ["a"]}\nnot json\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2"):
        load_benchmark(str(bad))
    with pytest.raises(DatasetError, match="not found"):
        load_benchmark(str(tmp_path / "missing.json"))
    with pytest.raises(UsageError):
        parse_dataset_spec("hf:x?nonsense=1")
    with pytest.raises(UsageError):
        load_benchmark(str(_squad(tmp_path / "s.json")), corpus="everything")


def test_spec_parsing():
    spec = parse_dataset_spec("sq=hf:rajpurkar/squad#plain_text:validation?answers=answers.text")
    assert (spec.name, spec.source, spec.config, spec.split) == ("sq", "rajpurkar/squad", "plain_text", "validation")
    assert spec.columns == {"answers": "answers.text"}
    assert parse_dataset_spec("hf:/data/local_set").split == "validation"


def test_hf_dataset_from_local_json_folder(tmp_path):
    folder = tmp_path / "flash"
    folder.mkdir()
    rows = [{"qid": f"q{i}", "query": f"What is {i}?", "golden_answers": [str(i)], "ctx": f"{i} is {i}.",
             "topic": "Numbers"} for i in range(4)]
    (folder / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    spec = f"nums=hf:{folder}:validation?id=qid&question=query&answers=golden_answers&context=ctx&title=topic"
    bench = load_benchmark(spec, limit=2, seed=1)
    assert bench.name == "nums" and len(bench.questions) == 2
    q = bench.questions[0]
    assert q.answers == [q.id[1:]] and q.gold_ids == [f"numbers/{q.id[1:]}"]
    assert len(bench.passages) == 4  # same article: all its paragraphs


def test_hf_dataset_saved_to_disk_with_nested_answers(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([
        {"id": "s1", "title": "Alpha", "context": "Alpha is first.", "question": "What is first?",
         "answers": {"text": ["Alpha", "alpha"], "answer_start": [0, 0]}},
        {"id": "s2", "title": "Beta", "context": "Beta is second.", "question": "What is second?",
         "answers": {"text": ["Beta"], "answer_start": [0]}},
    ])
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "saved"))
    bench = load_benchmark(f"hf:{tmp_path / 'saved'}?answers=answers.text", corpus="full")
    assert [q.answers for q in bench.questions] == [["Alpha", "alpha"], ["Beta"]]
    assert [p.id for p in bench.passages] == ["alpha/0", "beta/0"]


def test_squad_passages_match_the_corpus_reader(tmp_path):
    corpus = pytest.importorskip("cachegraft_cli.corpus")
    path = _squad(tmp_path / "tiny.json")
    theirs = [(p.id, p.title, p.text) for p in corpus.read_corpus(str(path))]
    mine = [(p.id, p.title, p.text) for p in load_benchmark(str(path), corpus="full").passages]
    assert mine == theirs


def test_restrict_articles_keeps_whole_articles():
    from cachegraft_cli.evaluation.datasets import QAExample, restrict_articles

    qs = [QAExample(f"q{i}", "?", ["a"], [f"t{i % 4}/0"], f"t{i % 4}") for i in range(20)]
    kept = restrict_articles(qs, 2, seed=1)
    assert len({q.title for q in kept}) == 2 and len(kept) == 10
    assert kept == restrict_articles(qs, 2, seed=1)  # seeded
    assert restrict_articles(qs, None, seed=1) == qs


def test_per_benchmark_articles_and_limit_override_the_run_settings(tmp_path):
    import json

    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.evaluation.datasets import load_benchmark, parse_dataset_spec

    articles = [{"title": f"T{a}", "paragraphs": [{"context": f"ctx {a} {p}", "qas": [
        {"id": f"q{a}{p}{i}", "question": "?", "answers": [{"text": "x"}]} for i in range(3)]} for p in range(2)]}
        for a in range(4)]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({"data": articles}))
    spec = parse_dataset_spec(f"small={path}?articles=1&limit=4")
    assert (spec.articles, spec.limit, spec.to_dict()["limit"]) == (1, 4, 4)
    bench = load_benchmark(spec, limit=100, articles=3)
    assert len(bench.questions) == 4 and len({q.title for q in bench.questions}) == 1
    assert len(load_benchmark(f"all={path}", limit=100, articles=3).questions) == 18
    assert "limit" not in parse_dataset_spec(str(path)).to_dict()
    with pytest.raises(UsageError, match="limit"):
        parse_dataset_spec(f"{path}?limit=zero")
