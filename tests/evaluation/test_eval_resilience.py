"""`evaluate` goes on when a question retrieves nothing (scored as a miss); model paths are
recorded absolute, so a store answers from any directory."""

from __future__ import annotations

import json

from cli_support import run_cli


def run(capsys, monkeypatch, *args):
    return run_cli(capsys, monkeypatch, *args)


def test_a_question_that_retrieves_nothing_is_a_miss_and_the_run_goes_on(tiny_dirs, tmp_path, capsys, monkeypatch):
    data = {"data": [{"title": "Harbor", "paragraphs": [{"context": "Harbor town was founded in 1820 by fishermen.",
                                                         "qas": [
        {"id": "found", "question": "When was Harbor town founded?", "answers": [{"text": "1820"}]},
        {"id": "nothing", "question": "zzqx vvbnm?", "answers": [{"text": "none"}]}]}]}]}
    qa = tmp_path / "qa.json"
    qa.write_text(json.dumps(data))
    code, out, err = run(capsys, monkeypatch, "evaluate", "-B", f"tiny={qa}", "--out", tmp_path / "run", "--stores",
                         tmp_path / "stores", "--receiver", tiny_dirs["receiver"], "--fuser", "closed", "--systems",
                         "graft,text", "--k", "1", "--dtype", "float32", "--max-new-tokens", 3, "--json")
    assert code == 0, err
    answers = {(a["id"], a["system"]): a for a in map(json.loads, (tmp_path / "run" / "answers.jsonl").open())}
    assert len(answers) == 4
    for system in ("graft", "text"):
        miss = answers[("nothing", system)]
        assert miss["answer"] == "" and miss["retrieved"] == [] and miss["em"] == 0 and miss["recall"] == 0
        assert answers[("found", system)]["retrieved"]
    summary = json.loads(out)
    assert {s["system"]: s["n"] for s in summary["systems"]} == {"graft": 2, "text": 2}


def test_relative_model_paths_are_recorded_absolute(tiny_dirs, tmp_path, capsys, monkeypatch):
    import shutil

    from cachegraft_cli.store import CacheStore

    work = tmp_path / "work"
    shutil.copytree(tiny_dirs["receiver"], work / "models" / "receiver")
    corpus = work / "c.jsonl"
    corpus.write_text(json.dumps({"id": "a", "text": "Harbor town was founded in 1820."}) + "\n")
    monkeypatch.chdir(work)
    code, _, err = run(capsys, monkeypatch, "encode", "c.jsonl", "--store", "store", "--receiver", "./models/receiver",
                       "--dtype", "float32")
    assert code == 0, err
    assert CacheStore.open(str(work / "store")).identity["receiver"]["name"] == str(work / "models" / "receiver")
    code, _, err = run(capsys, monkeypatch, "index", "--store", "store")
    assert code == 0, err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, err = run(capsys, monkeypatch, "ask", "When was Harbor town founded?", "--store", work / "store",
                         "--json", "--max-new-tokens", 2)
    assert code == 0 and json.loads(out)["passages"][0]["id"] == "a", err
    code, out, err = run(capsys, monkeypatch, "encode", work / "c.jsonl", "--store", work / "store", "--receiver",
                         work / "models" / "receiver", "--dtype", "float32", "--json")
    assert code == 0 and json.loads(out)["skipped_existing"] == 1, err  # the same weights by absolute path
