"""`cachegraft evaluate` with the real answerer and tiny models: the CLI end to end,
graft == cache under a closed fuser, and what the answerer keeps in memory."""

import json
import sys
from dataclasses import replace

import pytest
from tiny import open_fuser

from cachegraft_cli.cli.app import main

ARTICLES = [
    ("Harbor town", "Harbor town was founded in 1820 by fishermen who built the first lighthouse.",
     [("h1", "Who built the lighthouse?", "fishermen"), ("h2", "When was Harbor town founded?", "1820")]),
    ("Treaty", "The treaty was signed in Vienna after long talks between the two empires.",
     [("t1", "Where was the treaty signed?", "Vienna")]),
    ("Photosynthesis", "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
     [("p1", "What does photosynthesis make?", "sugar and oxygen")]),
]


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    data = [{"title": title, "paragraphs": [{"context": text, "qas": [
        {"id": i, "question": q, "answers": [{"text": a, "answer_start": text.find(a)}]} for i, q, a in qas]}]}
        for title, text, qas in ARTICLES]
    path = tmp_path_factory.mktemp("qa") / "tiny.json"
    path.write_text(json.dumps({"data": data}))
    return path


def _fuser_dir(tiny_models, path, sharer_input="model"):
    from cachegraft_cli.fuser.checkpoint import save_published

    save_published(open_fuser(tiny_models["receiver"], tiny_models["sharer_same"], sharer_input=sharer_input), path)
    return str(path)


def test_evaluate_cli_closed_fuser_graft_equals_cache(qa_file, tiny_dirs, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["cachegraft", "evaluate", "-B", f"tiny={qa_file}", "--out", out, "--stores", tmp_path / "stores",
            "--receiver", tiny_dirs["receiver"], "--sharer", tiny_dirs["sharer_same"], "--fuser", "closed",
            "--systems", "graft,text,cache,closed", "--k", "1,2", "--max-new-tokens", "3",
            "--dtype", "float32", "--codec", "float32", "--json"]
    monkeypatch.setattr(sys, "argv", list(map(str, args)))
    with pytest.raises(SystemExit) as info:
        main()
    stdout = capsys.readouterr().out
    assert (info.value.code or 0) == 0
    summary = json.loads(stdout)
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 4 * (3 * 2 + 1)  # 4 questions x (graft, text, cache at k=1,2 + closed)
    by = {(a["id"], a["system"], a["k"]): a for a in answers}
    for qid in ("h1", "h2", "t1", "p1"):
        for k in (1, 2):
            graft, cache = by[(qid, "graft", k)], by[(qid, "cache", k)]
            assert graft["answer"] == cache["answer"] and graft["retrieved"] == cache["retrieved"]
            assert 1 <= len(graft["retrieved"]) <= k  # BM25 returns only passages that share a term
    ties = [c for c in summary["comparisons"] if c["b"] == "cache"]
    assert ties and all(c["wins"] == c["losses"] == 0 for c in ties)
    assert (out / "report.md").read_text().startswith("# CacheGraft evaluation")


def test_answerer_shares_the_receiver_and_drops_the_sharer_after_encoding(qa_file, tiny_dirs, tiny_models, tmp_path):
    from cachegraft_cli.evaluation.answerer import AnswererConfig, StoreAnswerer
    from cachegraft_cli.evaluation.datasets import load_benchmark

    fuser = _fuser_dir(tiny_models, tmp_path / "open")
    adapter = _fuser_dir(tiny_models, tmp_path / "adapter", sharer_input="zero")
    config = AnswererConfig(str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"]), fuser, adapter,
                            codec="float32", max_new_tokens=2, dtype="float32", stores_dir=str(tmp_path / "stores"))
    bench = load_benchmark(f"tiny={qa_file}")
    answerer = StoreAnswerer(config, ["graft", "adapter", "text"])
    answerer.prepare(bench.name, bench.passage_dicts())
    main_session, adapter_session = (answerer._session(f) for f in (fuser, adapter))
    assert adapter_session.receiver is main_session.receiver
    assert adapter_session.notes_written is main_session.notes_written  # the sharer's notes are written once
    assert "sharer" not in main_session.__dict__ and "_fusion" not in main_session.__dict__
    graft = answerer.answer(bench.name, bench.questions[:2], "graft", 1)
    adapted = answerer.answer(bench.name, bench.questions[:2], "adapter", 1)
    assert len(graft) == len(adapted) == 2 and all(r["passages"] for r in graft + adapted)
    assert "sharer" not in main_session.__dict__  # answering graft never needs it
    # stores already encoded: preparing again loads no model at all
    again = StoreAnswerer(config, ["graft", "sharer-text"])
    again.prepare(bench.name, bench.passage_dicts())
    assert "receiver" not in again._session(fuser).__dict__ and "sharer" not in again._session(fuser).__dict__
    # with sharer-text among the systems, a sharer loaded to encode stays loaded
    keep = StoreAnswerer(replace(config, stores_dir=str(tmp_path / "fresh")), ["graft", "sharer-text"])
    keep.prepare(bench.name, bench.passage_dicts())
    assert "sharer" in keep._session(fuser).__dict__


def test_another_sample_of_a_benchmark_gets_its_own_store_and_index(qa_file, tiny_dirs, tiny_models, tmp_path):
    """Two corpora under one benchmark name and one --stores (another --limit or --seed): each
    its own store, holding its own passages only, so retrieval never reaches the other's."""
    from cachegraft_cli.evaluation.answerer import AnswererConfig, StoreAnswerer
    from cachegraft_cli.evaluation.datasets import load_benchmark
    from cachegraft_cli.store import CacheStore

    fuser = _fuser_dir(tiny_models, tmp_path / "fuser")
    config = AnswererConfig(str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"]), fuser, codec="float32",
                            max_new_tokens=2, dtype="float32", stores_dir=str(tmp_path / "stores"))
    bench = load_benchmark(f"tiny={qa_file}")
    passages = bench.passage_dicts()
    for sample in (passages, passages[:1], list(reversed(passages))):
        answerer = StoreAnswerer(config, ["graft"])
        answerer.prepare(bench.name, sample)
        got = answerer.answer(bench.name, bench.questions, "graft", 3)
        assert {p["id"] for r in got for p in r["passages"]} == {p["id"] for p in sample}
    stores = sorted((tmp_path / "stores").iterdir())
    assert len(stores) == 2  # the same passages in another order: the same store
    assert sorted(len(CacheStore.open(str(p)).ids()) for p in stores) == [1, len(passages)]


def test_evaluate_answer_batch_gives_the_one_at_a_time_answers(qa_file, tiny_dirs, tiny_models, tmp_path):
    """`--answer-batch 3` decodes questions together (Asker.ask_many): in float32 every
    answer and score equals the one-at-a-time run, and its config records the batch."""
    from cachegraft_cli.evaluation.answerer import AnswererConfig, StoreAnswerer
    from cachegraft_cli.evaluation.protocol import RunConfig, run_evaluation

    fuser = _fuser_dir(tiny_models, tmp_path / "fuser")

    def run(batch: int, name: str) -> list[dict]:
        config = AnswererConfig(str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"]), fuser, codec="float32",
                                max_new_tokens=4, dtype="float32", answer_batch=batch,
                                stores_dir=str(tmp_path / "stores"))
        systems = ["graft", "text", "graft@recompute=0"]
        run_config = RunConfig([f"tiny={qa_file}"], systems, tmp_path / name, ks=(1, 3),
                               answerer_config=config.results_key())
        run_evaluation(run_config, StoreAnswerer(config, systems), progress=False)
        rows = [json.loads(line) for line in (tmp_path / name / "answers.jsonl").read_text().splitlines()]
        return sorted(rows, key=lambda a: (a["system"], a["k"], a["id"]))

    one, batched = run(1, "one"), run(3, "batched")
    assert len(one) == len(batched) == 4 * 3 * 2
    for a, b in zip(one, batched):
        assert (a["system"], a["k"], a["id"]) == (b["system"], b["k"], b["id"])
        assert (a["answer"], a["retrieved"], a["em"]) == (b["answer"], b["retrieved"], b["em"])
    assert "batch" in batched[0]["timings"] and "batch" not in one[0]["timings"]
    saved = json.loads((tmp_path / "batched" / "config.json").read_text())
    assert saved["answerer"]["answer_batch"] == 3
    assert "answer_batch" not in json.loads((tmp_path / "one" / "config.json").read_text())["answerer"]


def _evaluate_open_fuser(systems: str, qa_file, tiny_dirs, tiny_models, tmp_path, monkeypatch, capsys) -> dict:
    """`cachegraft evaluate --systems SYSTEMS --json` with an open tiny fuser, k = 1; its summary
    (answers in tmp_path/run, stores in tmp_path/stores)."""
    fuser = _fuser_dir(tiny_models, tmp_path / "open")
    args = ["cachegraft", "evaluate", "-B", f"tiny={qa_file}", "--out", tmp_path / "run", "--stores",
            tmp_path / "stores", "--receiver", tiny_dirs["receiver"], "--sharer", tiny_dirs["sharer_same"],
            "--fuser", fuser, "--systems", systems, "--k", "1", "--max-new-tokens", "3",
            "--dtype", "float32", "--codec", "float32", "--json"]
    monkeypatch.setattr(sys, "argv", list(map(str, args)))
    with pytest.raises(SystemExit) as info:
        main()
    summary = json.loads(capsys.readouterr().out)
    assert (info.value.code or 0) == 0
    return summary


def test_evaluate_mismatched_reads_its_own_control_store_and_is_compared_with_graft(qa_file, tiny_dirs, tiny_models,
                                                                                    tmp_path, monkeypatch, capsys):
    from cachegraft_cli.store import CacheStore

    summary = _evaluate_open_fuser("graft,mismatched", qa_file, tiny_dirs, tiny_models, tmp_path, monkeypatch, capsys)
    out, stores = tmp_path / "run", tmp_path / "stores"
    inputs = sorted(CacheStore.open(str(p)).identity["fuser"].get("sharer_input", "model") for p in stores.iterdir())
    assert inputs == ["mismatched", "model"]  # one store each, the control's recorded as such
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert sorted({a["system"] for a in answers}) == ["graft", "mismatched"] and len(answers) == 8
    assert [c for c in summary["comparisons"] if (c["a"], c["b"]) == ("graft", "mismatched")]


def test_evaluate_mismatched_with_notes_builds_only_the_stores_asked_for(qa_file, tiny_dirs, tiny_models, tmp_path,
                                                                          monkeypatch, capsys):
    from cachegraft_cli.store import CacheStore

    _evaluate_open_fuser("graft@notes=3,mismatched@notes=3", qa_file, tiny_dirs, tiny_models, tmp_path, monkeypatch,
                         capsys)
    out, stores = tmp_path / "run", tmp_path / "stores"
    made = [CacheStore.open(str(p)).identity for p in stores.iterdir()]
    assert sorted(i["fuser"].get("sharer_input", "model") for i in made) == ["mismatched", "model"]
    assert all(i["notes"]["tokens"] == 3 for i in made)  # no store without notes was made
    answers = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert sorted({a["system"] for a in answers}) == ["graft@notes=3", "mismatched@notes=3"]
