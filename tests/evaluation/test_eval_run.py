"""The evaluation run end to end with a fake answerer and a deterministic stub judge."""

import json

import pytest

from cachegraft_cli.errors import UsageError
from cachegraft_cli.evaluation.judges import Verdict
from cachegraft_cli.evaluation.protocol import RunConfig, run_evaluation
from cachegraft_cli.evaluation.records import ANSWER_KEY, RecordFile

N = 30


def write_qa(path):
    """30 questions q00..q29 over two articles; the gold answer of qNN is 'valueNN'."""
    articles = []
    for a, title in enumerate(["Alpha_Topic", "Beta Topic"]):
        paragraphs = []
        for p in range(3):
            qas = [{"id": f"q{i:02d}", "question": f"What is item {i}?", "answers": [{"text": f"value{i:02d}"}]}
                   for i in range(N) if i % 6 == a * 3 + p]
            paragraphs.append({"context": f"Paragraph {p} of {title}.", "qas": qas})
        articles.append({"title": title, "paragraphs": paragraphs})
    path.write_text(json.dumps({"data": articles}))
    return path


class FakeAnswerer:
    """Deterministic by question number i:
    text right for even i (else 'valueNN perhaps'); graft right unless i % 5 == 0;
    cache right for i < 3; closed never. Gold passage at rank i % 4."""

    def __init__(self, fail_after=None):
        self.fail_after, self.count, self.prepared, self.closed = fail_after, 0, {}, 0
        self.calls = []

    def prepare(self, name, passages):
        self.prepared[name] = [p["id"] for p in passages]

    def answer(self, name, questions, system, k):
        self.calls.append((system, k, len(questions)))
        out = []
        for q in questions:
            if self.fail_after is not None and self.count >= self.fail_after:
                raise RuntimeError("killed")
            self.count += 1
            out.append(self._one(name, q, system, k))
        return out

    def _one(self, name, q, system, k):
        i, gold = int(q.id[1:]), q.answers[0]
        answer = {"text": gold if i % 2 == 0 else f"{gold} perhaps", "graft": "unknown" if i % 5 == 0 else gold,
                  "cache": gold if i < 3 else "no idea", "closed": "no idea"}[system]
        others = [p for p in self.prepared[name] if p not in q.gold_ids]
        ranked = others[:i % 4] + q.gold_ids + others[i % 4:]
        passages = [] if system == "closed" else [{"id": p, "score": 1.0 / (r + 1)} for r, p in enumerate(ranked[:k])]
        return {"answer": answer, "passages": passages, "timings": {"first_token": 0.01 * k, "total": 0.5},
                "stats": {"bytes_read": 1000 * k}}

    def close_models(self):
        self.closed += 1


class StubJudge:
    """Correct iff the first gold answer occurs in the candidate."""

    def __init__(self, name, fail_after=None):
        self.name, self.fail_after, self.count, self.closed = name, fail_after, 0, False

    def judge(self, items):
        out = []
        for item in items:
            if self.fail_after is not None and self.count >= self.fail_after:
                raise RuntimeError("judge killed")
            self.count += 1
            hit = item.golds[0].lower() in item.candidate.lower()
            out.append(Verdict(int(hit), 0.9 if hit else 0.2))
        return out

    def close(self):
        self.closed = True


def make_config(qa, out, **kw):
    base = dict(benchmarks=[f"tiny={qa}"], systems=["graft", "text", "cache", "closed"], out=out, ks=[1, 3],
                judges=["stub/judge-a"], seed=7, bootstrap_samples=300)
    return RunConfig(**{**base, **kw})


def stub_loader(fail_after=None):
    loaded = []

    def load(spec):
        loaded.append(StubJudge(spec, fail_after))
        return loaded[-1]

    load.loaded = loaded
    return load


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    qa = write_qa(root / "tiny.json")
    answerer, loader = FakeAnswerer(), stub_loader()
    summary = run_evaluation(make_config(qa, root / "out"), answerer, loader, progress=False)
    return {"root": root, "qa": qa, "out": root / "out", "summary": summary, "answerer": answerer, "loader": loader}


def _row(rows, **match):
    (hit,) = [r for r in rows if all(r[k] == v for k, v in match.items())]
    return hit


def test_outputs_and_files(full_run):
    out = full_run["out"]
    for name in ("config.json", "answers.jsonl", "verdicts.jsonl", "summary.json", "report.md",
                 "plots/comparisons.png", "plots/scores_0_tiny.png"):
        assert (out / name).exists(), name
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == N * (3 * 2 + 1)  # closed answered once, not per k
    assert {a["k"] for a in answers if a["system"] == "closed"} == {0}
    verdicts = (out / "verdicts.jsonl").read_text().splitlines()
    assert len(verdicts) == len(answers)
    assert full_run["answerer"].closed == 1 and full_run["loader"].loaded[0].closed
    assert json.loads((out / "summary.json").read_text()) == full_run["summary"]


def test_summary_numbers(full_run):
    s = full_run["summary"]["systems"]
    assert _row(s, system="text", k=1)["em"] == pytest.approx(0.5)
    # odd i: 'valueNN perhaps' vs 'valueNN' -> F1 2/3
    assert _row(s, system="text", k=3)["f1"] == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert _row(s, system="graft", k=1)["em"] == pytest.approx(24 / 30)
    assert _row(s, system="cache", k=3)["em"] == pytest.approx(3 / 30)
    assert _row(s, system="closed", k=0)["em"] == 0.0 and _row(s, system="closed", k=0)["recall"] is None
    assert _row(s, system="graft", k=1)["recall"] == pytest.approx(8 / 30)  # i % 4 == 0
    assert _row(s, system="graft", k=3)["recall"] == pytest.approx(23 / 30)  # i % 4 < 3
    g1 = _row(s, system="graft", k=1)
    assert g1["em_ci"][0] <= g1["em"] <= g1["em_ci"][1]
    assert g1["timings"] == {"first_token": pytest.approx(0.01), "total": 0.5} and g1["stats"] == {"bytes_read": 1000}
    judged = _row(full_run["summary"]["judge_scores"], system="text", k=1)
    assert judged["accuracy"] == 1.0 and judged["judge"] == "judge-a"


def test_comparisons_and_headline(full_run):
    summary = full_run["summary"]
    comps = summary["comparisons"]
    em = _row(comps, a="graft", b="text", judge="em", k=1)
    # graft right & text wrong: odd i not divisible by 5 -> 12; reverse: even multiples of 5 -> 3
    assert (em["wins"], em["ties"], em["losses"]) == (12, 15, 3)
    assert em["mean_diff"] == pytest.approx(9 / 30)
    assert em["p_value"] == pytest.approx(2 * 576 / 2**15)
    judged = _row(comps, a="graft", b="text", judge="judge-a", k=3)
    assert (judged["wins"], judged["ties"], judged["losses"]) == (0, 24, 6)
    # Holm over the 4 graft-vs-text comparisons: every adjusted p is 4 * 1/32
    assert judged["p_holm"] == pytest.approx(0.125) and em["p_holm"] == pytest.approx(0.125)
    head = summary["headlines"]
    assert head["graft vs text"] == "graft better than text in 2 of 4 comparisons, 2 significant (0 after Holm)"
    assert head["graft vs cache"] == "graft better than cache in 4 of 4 comparisons, 4 significant (4 after Holm)"
    assert "graft vs adapter" not in head
    kappa = summary["judge_agreement"][0]
    assert kappa["judge"] == "judge-a" and kappa["n"] == 7 * N and -1 <= kappa["kappa_em"] <= 1
    # the stub says 0.9 for every answer containing the gold (EM or "gold perhaps"), else 0.2: every
    # EM-correct answer outscores every answer without the gold, ties with the "perhaps" ones
    assert 0.5 < kappa["auc_em"] < 1.0


def test_report_structure(full_run):
    report = (full_run["out"] / "report.md").read_text()
    lines = report.splitlines()
    assert lines[0] == "# CacheGraft evaluation"
    assert "graft better than text in 2 of 4 comparisons, 2 significant (0 after Holm)" in lines
    assert "graft better than cache in 4 of 4 comparisons, 4 significant (4 after Holm)" in lines
    for heading in ("## Scores: tiny", "## Judge accuracy (% judged correct)", "## Judge agreement (Cohen's kappa)",
                    "## Comparison: graft vs text", "## Comparison: graft vs cache", "## Plots"):
        assert heading in lines, heading
    assert "| graft | 1 | 30 | 80.0 [" in report
    assert "| tiny | em | 1 | 30 | 12/15/3 | 30.0 [" in report
    assert "![plots/comparisons.png](plots/comparisons.png)" in report


def test_resume_after_kills_equals_uninterrupted(full_run, tmp_path):
    qa, out = full_run["qa"], tmp_path / "out"
    config = make_config(qa, out)
    with pytest.raises(RuntimeError, match="killed"):
        run_evaluation(config, FakeAnswerer(fail_after=37), stub_loader(), progress=False)
    assert len(RecordFile(out / "answers.jsonl", ANSWER_KEY)) == 30  # whole batches of 8 before the kill
    with open(out / "answers.jsonl", "a") as fh:
        fh.write('{"benchmark": "tiny", "id": "q1')  # torn last line
    with pytest.raises(RuntimeError, match="judge killed"):
        run_evaluation(config, FakeAnswerer(), stub_loader(fail_after=50), progress=False)
    resumed = FakeAnswerer()
    summary = run_evaluation(config, resumed, stub_loader(), progress=False)
    assert resumed.count == 0  # everything was answered before the judge died
    assert summary == full_run["summary"]
    assert (out / "report.md").read_text() == (full_run["out"] / "report.md").read_text()
    # a finished run re-run does no work and loads nothing
    loader = stub_loader()
    assert run_evaluation(config, FakeAnswerer(), loader, progress=False) == summary and not loader.loaded


def test_config_mismatch_on_resume(full_run, tmp_path):
    out = tmp_path / "out"
    run_evaluation(make_config(full_run["qa"], out, judges=[], systems=["closed"]), FakeAnswerer(), progress=False)
    with pytest.raises(UsageError, match="seed: was 7, now 8"):
        run_evaluation(make_config(full_run["qa"], out, judges=[], systems=["closed"], seed=8), FakeAnswerer())


def test_em_only_run_and_bad_settings(full_run, tmp_path):
    summary = run_evaluation(make_config(full_run["qa"], tmp_path / "o", judges=[], ks=[2], limit=10),
                             FakeAnswerer(), progress=False)
    assert {c["judge"] for c in summary["comparisons"]} == {"em"}
    assert summary["counts"] == {"answers": 10 * 4, "verdicts": 0, "pairwise": 0}
    with pytest.raises(UsageError, match="Unknown system 'oracle'"):
        run_evaluation(make_config(full_run["qa"], tmp_path / "x", systems=["oracle"]), FakeAnswerer())
    with pytest.raises(UsageError, match="ks must be"):
        run_evaluation(make_config(full_run["qa"], tmp_path / "x", ks=[0]), FakeAnswerer())


def test_judge_limit_judges_the_same_question_subset_for_every_system(full_run, tmp_path):
    loader = stub_loader()
    summary = run_evaluation(make_config(full_run["qa"], tmp_path / "o", judge_limit=8), FakeAnswerer(), loader,
                             progress=False)
    verdicts = [json.loads(line) for line in (tmp_path / "o" / "verdicts.jsonl").read_text().splitlines()]
    judged: dict[tuple, set] = {}
    for v in verdicts:
        judged.setdefault((v["system"], v["k"]), set()).add(v["id"])
    subsets = list(judged.values())
    assert len(subsets) == 7 and all(len(s) == 8 and s == subsets[0] for s in subsets)  # 3 systems x 2 k + closed
    full_verdicts = (full_run["out"] / "verdicts.jsonl").read_text().splitlines()
    assert summary["counts"]["verdicts"] == 8 * 7 < len(full_verdicts)
    judged_rows = [c for c in summary["comparisons"] if c["judge"] != "em" and c["b"] == "text"]
    assert judged_rows and all(c["n"] == 8 for c in judged_rows)
    assert all(c["n"] == N for c in summary["comparisons"] if c["judge"] == "em" and c["b"] == "text")
    assert json.loads((tmp_path / "o" / "config.json").read_text())["judge_limit"] == 8


def test_resume_may_add_and_drop_judges_without_reanswering(full_run, tmp_path):
    qa, out = full_run["qa"], tmp_path / "out"
    run_evaluation(make_config(qa, out, judges=[]), FakeAnswerer(), stub_loader(), progress=False)
    answerer, loader = FakeAnswerer(), stub_loader()
    summary = run_evaluation(make_config(qa, out), answerer, loader, progress=False)
    assert answerer.count == 0 and [j.name for j in loader.loaded] == ["stub/judge-a"]
    assert summary == full_run["summary"]  # same as judging from the start
    loader = stub_loader()
    both = run_evaluation(make_config(qa, out, judges=["stub/judge-a", "stub/judge-b"]), FakeAnswerer(), loader,
                          progress=False)
    assert [j.name for j in loader.loaded] == ["stub/judge-b"]  # judge-a's verdicts are kept
    assert {a["judge"] for a in both["judge_agreement"]} == {"judge-a", "judge-b"}
    only_b = run_evaluation(make_config(qa, out, judges=["stub/judge-b"]), FakeAnswerer(), stub_loader(),
                            progress=False)
    assert {c["judge"] for c in only_b["comparisons"]} == {"em", "judge-b"}
    assert only_b["counts"]["verdicts"] == 7 * N
    saved = json.loads((out / "config.json").read_text())
    assert [j["name"] for j in saved["judges"]] == ["judge-b"]
    with pytest.raises(UsageError, match="judge_limit"):
        run_evaluation(make_config(qa, out, judges=["stub/judge-b"], judge_limit=5), FakeAnswerer())


class VariantAnswerer(FakeAnswerer):
    """`text@order=retrieval` is right unless i % 3 == 0 (better than `text` at k=3 only)."""

    def _one(self, name, q, system, k):
        if system == "text@order=retrieval":
            out = super()._one(name, q, "text", k)
            i = int(q.id[1:])
            out["answer"] = q.answers[0] if (k == 3 and i % 3) else f"{q.answers[0]} perhaps"
            return out
        return super()._one(name, q, system.split("@")[0], k)


def test_system_variants_and_text_at_its_best_order(full_run, tmp_path):
    systems = ["graft", "text", "text@order=retrieval", "graft@recompute=0"]
    summary = run_evaluation(make_config(full_run["qa"], tmp_path / "v", systems=systems, judges=[]),
                             VariantAnswerer(), progress=False)
    labels = {s["system"] for s in summary["systems"]}
    assert labels == set(systems)
    best = {(b["k"]): b["system"] for b in summary["best_text"]}
    assert best == {1: "text", 3: "text@order=retrieval"}  # text's own best order, per k
    rows = {c["k"]: c for c in summary["comparisons"] if c["b"] == "text (best order)"}
    text_em = {s["k"]: s["em"] for s in summary["systems"] if s["system"] == best[s["k"]]}
    graft_em = {s["k"]: s["em"] for s in summary["systems"] if s["system"] == "graft"}
    for k in (1, 3):
        assert rows[k]["mean_diff"] == pytest.approx(graft_em[k] - text_em[k])
    assert "graft vs text (best order)" in summary["headlines"]
    assert "graft vs text (best order)" in (tmp_path / "v" / "report.md").read_text()


@pytest.mark.parametrize("label, words", [("text@order=random", "passage order"), ("graft@recompute=x", "Bad value"),
                                          ("text@colour=red", "Bad system option")])
def test_bad_system_variants_are_refused(full_run, tmp_path, label, words):
    with pytest.raises(UsageError, match=words):
        run_evaluation(make_config(full_run["qa"], tmp_path / "b", systems=["graft", label]), FakeAnswerer())
