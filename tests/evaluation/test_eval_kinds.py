"""Answer kinds: where a wrong answer's words come from, and how a partial one falls short."""

import json

import pytest

from cachegraft_cli.evaluation import kinds
from cachegraft_cli.evaluation.kinds import PassageWords, answer_kind, answer_source, kind_shares
from cachegraft_cli.evaluation.metrics import exact_match, f1_score
from cachegraft_cli.evaluation.protocol import run_evaluation

PASSAGES = {"gold": "The Eiffel Tower stands in Paris, France.", "other": "Berlin is the capital of Germany.",
            "far": "Cats sleep a lot."}
WORDS = PassageWords(PASSAGES)


def record(answer, golds, source=None, **extra):
    out = {"answer": answer, "golds": golds, "em": exact_match(answer, golds), "f1": f1_score(answer, golds)}
    return {**out, **({"source": source} if source is not None else {}), **extra}


@pytest.mark.parametrize("answer, retrieved, gold_ids, want", [
    ("in Paris", ["other", "gold"], ["gold"], "gold"),          # normalised (case, punctuation) whole words
    ("Berlin!", ["other", "gold"], ["gold"], "other"),
    ("Berlin", ["gold"], ["gold"], "none"),                     # only passages that were retrieved count
    ("Pari", ["gold"], ["gold"], "none"),                       # whole words, not a prefix of one
    ("the capital", ["other"], [], "retrieved"),                # no gold ids: in a passage or not
    ("Rome", ["other"], [], "none"),
    ("", ["gold"], ["gold"], None),
    ("Paris", ["unknown-id"], ["gold"], "none"),
])
def test_answer_source(answer, retrieved, gold_ids, want):
    assert answer_source(answer, retrieved, gold_ids, WORDS) == want


@pytest.mark.parametrize("rec, want", [
    (record("Paris", ["paris"]), kinds.RIGHT),
    (record("Paris", ["Paris, France"]), kinds.CUT_SHORT),
    (record("in Paris, France, Europe", ["Paris, France"]), kinds.TOO_LONG),
    (record("Paris, Texas", ["Paris, France"]), kinds.PARTLY),
    (record("Eiffel Tower", ["Paris"], "gold"), kinds.WRONG_SPAN),
    (record("Berlin", ["Paris"], "other"), kinds.OTHER_PASSAGE),
    (record("Berlin", ["Paris"], "retrieved"), kinds.IN_PASSAGES),
    (record("Rome", ["Paris"], "none"), kinds.NOT_IN_PASSAGES),
    (record("Rome", ["Paris"]), kinds.UNLOCATED),             # written before answers were located
    (record(" . ", ["Paris"]), kinds.EMPTY),
    (record("Paris", ["Lyon", "Paris, France"]), kinds.CUT_SHORT),  # against any of several references
])
def test_answer_kind(rec, want):
    assert answer_kind(rec) == want


def test_kind_shares_cover_every_kind():
    shares = kind_shares([record("Paris", ["Paris"]), record("Rome", ["Paris"], "none")])
    assert list(shares) == list(kinds.KINDS)
    assert shares[kinds.RIGHT] == 0.5 and shares[kinds.NOT_IN_PASSAGES] == 0.5 and sum(shares.values()) == 1.0


class SpanAnswerer:
    """One question per article's one paragraph; graft answers with the other paragraph's crop,
    text with its own paragraph's title word (a wrong span), cache right."""

    def prepare(self, name, passages, **_):
        self.passages = {p["id"]: p["text"] for p in passages}

    def answer(self, name, questions, system, k):
        out = []
        for q in questions:
            (gold,) = q.gold_ids
            other = next(p for p in self.passages if p != gold)
            word = {"graft": self.passages[other].split()[2], "text": self.passages[gold].split()[0],
                    "cache": q.answers[0]}[system]
            out.append({"answer": word, "passages": [{"id": other, "score": 2.0}, {"id": gold, "score": 1.0}]})
        return out

    def close_models(self):
        pass


def write_two_articles(path):
    data = [{"title": t, "paragraphs": [{"context": f"{t} grows {w} near rivers.",
                                         "qas": [{"id": f"{t}-q", "question": f"What does {t} grow?",
                                                  "answers": [{"text": w}]}]}]}
            for t, w in (("Alpha", "rice"), ("Beta", "wheat"))]
    path.write_text(json.dumps({"data": data}))
    return path


def test_a_run_reports_what_its_answers_are_and_a_resume_locates_old_ones(tmp_path):
    from cachegraft_cli.evaluation.protocol import RunConfig

    qa = write_two_articles(tmp_path / "two.json")
    config = RunConfig(benchmarks=[f"two={qa}"], systems=["graft", "text", "cache"], out=tmp_path / "out",
                       ks=[2], judges=[], seed=1, bootstrap_samples=50)
    summary = run_evaluation(config, SpanAnswerer(), progress=False)
    shares = {r["system"]: r["kinds"] for r in summary["kinds"]}
    assert shares["graft"][kinds.OTHER_PASSAGE] == 1.0
    assert shares["text"][kinds.WRONG_SPAN] == 1.0
    assert shares["cache"][kinds.RIGHT] == 1.0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## What the answers are: two (% of answers)" in report
    assert "| graft | 2 | 2 | 0.0 | 0.0 | 100.0 |" in report  # only kinds some answer has get a column
    # records written before answers were located: a resumed run adds their source
    path = tmp_path / "out" / "answers.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "source"}) + "\n" for r in lines))
    assert run_evaluation(config, SpanAnswerer(), progress=False) == summary
