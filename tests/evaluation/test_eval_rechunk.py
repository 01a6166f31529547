"""`-B FILE?passage_tokens=N`: a benchmark's corpus re-chunked as `encode --max-passage-tokens N`
stores it, with gold passages mapped to the chunks that hold them; end to end with tiny models."""

import json
import sys

import pytest

from cachegraft_cli.errors import UsageError
from cachegraft_cli.evaluation.datasets import load_benchmark, parse_dataset_spec, rechunk
from cachegraft_cli.session import ModelChoice, ModelSession

WORDS = "river stone harbor lamp garden tower bridge meadow cellar orchard".split()


def _paragraph(a: int, p: int) -> str:
    """A paragraph with one marker word found nowhere else (`marker{a}x{p}`)."""
    filler = " ".join(WORDS[(a + p + i) % len(WORDS)] for i in range(14))
    return f"The {filler} holds marker{a}x{p} near the {WORDS[p]}."


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    data = [{"title": f"Article {a}", "paragraphs": [
        {"context": _paragraph(a, p), "qas": [{"id": f"q{a}{p}", "question": f"What does marker{a}x{p} hold?",
                                              "answers": [{"text": WORDS[p]}]}]} for p in range(4)]}
        for a in range(2)]
    path = tmp_path_factory.mktemp("qa") / "long.json"
    path.write_text(json.dumps({"data": data}))
    return path


@pytest.fixture(scope="module")
def template(tiny_dirs):
    return ModelSession(ModelChoice(str(tiny_dirs["receiver"]), None, "closed", device="cpu", dtype="float32")).template


def test_the_option_is_parsed_checked_and_recorded():
    spec = parse_dataset_spec("s=dev.json?passage_tokens=512&limit=3")
    assert spec.passage_tokens == 512 and spec.to_dict()["passage_tokens"] == 512
    assert "passage_tokens" not in parse_dataset_spec("s=dev.json").to_dict()  # older run directories resume
    for bad in ("8", "x", "0"):
        with pytest.raises(UsageError, match="passage_tokens"):
            parse_dataset_spec(f"s=dev.json?passage_tokens={bad}")


def test_articles_are_joined_split_and_gold_follows_the_text(qa_file, template):
    bench = load_benchmark(str(qa_file))
    chunked = rechunk(bench, template, 48)
    assert chunked.max_passage_tokens == 48
    assert all(len(template.passage_ids(p.title, p.text)) <= 48 for p in chunked.passages)
    for a in range(2):
        ids = [p.id for p in chunked.passages if p.title == f"Article {a}"]
        assert len(ids) > 1 and ids == [f"article-{a}#{i}" for i in range(len(ids))]
    text = {p.id: p.text for p in chunked.passages}
    for q in chunked.questions:
        marker = q.question.split()[2]
        assert q.gold_ids and any(marker in text[g] for g in q.gold_ids)
        assert not any(marker in t for pid, t in text.items() if pid not in q.gold_ids)
    whole = rechunk(bench, template, 4096)  # an article that fits is one passage, under the document's id
    assert [p.id for p in whole.passages] == ["article-0", "article-1"]
    assert all(q.gold_ids == [f"article-{q.id[1]}"] for q in whole.questions)


def test_evaluate_re_chunks_and_keeps_the_chunked_store_apart(qa_file, tiny_dirs, tmp_path, monkeypatch, capsys):
    from cachegraft_cli.cli.app import main
    from cachegraft_cli.store import CacheStore

    def run(bench: str, out):
        args = ["cachegraft", "evaluate", "-B", bench, "--out", out, "--stores", tmp_path / "stores",
                "--receiver", tiny_dirs["receiver"], "--fuser", "closed", "--systems", "graft,text", "--k", "2",
                "--max-new-tokens", "2", "--dtype", "float32", "--codec", "float32", "--json"]
        monkeypatch.setattr(sys, "argv", list(map(str, args)))
        with pytest.raises(SystemExit) as info:
            main()
        capsys.readouterr()
        assert (info.value.code or 0) == 0
        return [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]

    chunked = run(f"long={qa_file}?passage_tokens=48", tmp_path / "chunked")
    native = run(f"long={qa_file}", tmp_path / "native")
    assert all(g.startswith("article-") and "#" in g for a in chunked for g in a["gold_ids"])
    assert all("#" in r for a in chunked for r in a["retrieved"])
    assert all("/" in g for a in native for g in a["gold_ids"])
    assert all("/" in r for a in native for r in a["retrieved"])
    stores = sorted((tmp_path / "stores").iterdir())
    assert len(stores) == 2  # one store each: the corpora never mix
    held = sorted(sorted(CacheStore.open(str(s)).ids()) for s in stores)
    assert all("#" in i for i in held[0]) and {i.split("#")[0] for i in held[0]} == {"article-0", "article-1"}
    assert held[1] == [f"article-{a}/{p}" for a in range(2) for p in range(4)]
