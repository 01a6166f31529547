
"""encode -> index -> ask through the CLI with tiny models: exactness, batch
mode, the sharer never loading for graft, and every error's exit code."""

import json
import shutil
import subprocess
import sys

import pytest
from cli_support import PASSAGES, QUESTIONS, run_cli
from conftest import MIN_GREEDY_MARGIN
from tiny import open_fuser


def run(capsys, monkeypatch, *args):
    """Invoke `cachegraft` in-process through main() (the real error mapping)."""
    return run_cli(capsys, monkeypatch, *args, forbid=())


def _corpus(path, passages):
    path.write_text("".join(json.dumps(p) + "\n" for p in passages))
    return path


def _encode(capsys, monkeypatch, corpus, store, receiver, *extra):
    code, out, err = run(capsys, monkeypatch, "encode", corpus, "--store", store, "--receiver", receiver,
                         "--dtype", "float32", "--codec", "float32", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def open_fuser_dir(tiny_models, tmp_path_factory):
    """A random fuser for receiver <- sharer_same with its gates open."""
    from cachegraft_cli.fuser.checkpoint import save_published

    path = tmp_path_factory.mktemp("fuser") / "open"
    save_published(open_fuser(tiny_models["receiver"], tiny_models["sharer_same"]), path)
    return path


def test_help_lists_stages_without_importing_torch():
    code = (
        "import sys; sys.argv=['cachegraft','--help']\n"
        "from cachegraft_cli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import at start-up'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for stage in ("encode", "index", "ask", "evaluate", "store", "models"):
        assert stage in proc.stdout


def test_version(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch, "--version")
    assert code == 0 and out.startswith("cachegraft ")


def test_graft_with_closed_fuser_equals_text_at_k1(tiny_dirs, tmp_path, capsys, monkeypatch, greedy_margins):
    """The exactness property through the whole CLI: single-passage store, fuser
    closed, k=1: the fused-cache answer and the text answer are the same tokens."""
    corpus = _corpus(tmp_path / "one.jsonl", PASSAGES[:1])
    store = tmp_path / "store"
    summary = _encode(capsys, monkeypatch, corpus, store, tiny_dirs["receiver"])
    assert summary["added"] == 1 and summary["tokens"] > 0
    assert run(capsys, monkeypatch, "index", "--store", store)[0] == 0
    answers = {}
    for system in ("graft", "text", "cache"):
        code, out, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "-k", 1, "--system", system,
                             "--json", "--max-new-tokens", 12)
        if system == "cache":
            assert code == 2 and "--also-own-cache" in err  # no own caches stored: a clear error
            continue
        assert code == 0, err
        answers[system] = json.loads(out)
    g, t = answers["graft"], answers["text"]
    assert g["tokens"]["generated"] > 0
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # equal up to rounding: decided on every CPU
    assert g["answer"] == t["answer"] and g["tokens"]["generated"] == t["tokens"]["generated"]
    assert g["passages"][0]["id"] == "harbor"
    assert set(g["timings"]) >= {"retrieve", "load", "prefill", "first_token", "total"}


def test_batch_mode_matches_single_calls(tiny_dirs, tmp_path, capsys, monkeypatch, greedy_margins):
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"])
    run(capsys, monkeypatch, "index", "--store", store)
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"id": f"q{i}", "question": q}) + "\n" for i, q in enumerate(QUESTIONS)))
    code, out, err = run(capsys, monkeypatch, "ask", "--questions", qfile, "--store", store, "-k", 2,
                         "--max-new-tokens", 8, "--batch-size", 3)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [x["id"] for x in lines] == ["q0", "q1", "q2"]
    for line, q in zip(lines, QUESTIONS):
        code, out, _ = run(capsys, monkeypatch, "ask", q, "--store", store, "-k", 2, "--json", "--max-new-tokens", 8)
        assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # a batch pads: equal up to rounding only
        assert json.loads(out)["answer"] == line["answer"]


def test_batch_mode_reports_questions_without_passages(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"])
    run(capsys, monkeypatch, "index", "--store", store)
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"id": "a", "question": QUESTIONS[0]}) + "\n"
                     + json.dumps({"id": "b", "question": "zzqx"}) + "\n")
    code, out, err = run(capsys, monkeypatch, "ask", "-q", qfile, "--store", store, "--max-new-tokens", 4)
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 10 and "1 of 2 questions" in err
    assert "answer" in lines[0] and "error" in lines[1] and lines[1]["id"] == "b"


def test_graft_never_loads_the_sharer(tiny_dirs, open_fuser_dir, tmp_path, capsys, monkeypatch):
    import cachegraft_cli.lm.models as models

    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"],
            "--sharer", tiny_dirs["sharer_same"], "--fuser", open_fuser_dir, "--also-own-cache")
    run(capsys, monkeypatch, "index", "--store", store)
    loaded = []
    real = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda spec, **kw: loaded.append(spec) or real(spec, **kw))
    code, out, err = run(capsys, monkeypatch, "ask", QUESTIONS[1], "--store", store, "--json", "--max-new-tokens", 6)
    assert code == 0, err
    assert loaded == [str(tiny_dirs["receiver"])]
    code, out_cache, _ = run(capsys, monkeypatch, "ask", QUESTIONS[1], "--store", store, "--json", "--system", "cache")
    assert code == 0 and json.loads(out_cache)["system"] == "cache"


def test_error_exit_codes(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    corpus = _corpus(tmp_path / "c.jsonl", PASSAGES)
    _encode(capsys, monkeypatch, corpus, store, tiny_dirs["receiver"])
    # missing index
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store)
    assert code == 9 and "cachegraft index --store" in err and "Traceback" not in err
    # an engine the kind has no part for, or an unknown one: refused before the store is read
    code, _, err = run(capsys, monkeypatch, "index", "--store", store, "--engine", "flat")
    assert code == 9 and "engine 'flat' searches vectors" in err and "Traceback" not in err
    code, _, err = run(capsys, monkeypatch, "index", "--store", store, "--engine", "lucene")
    assert code == 9 and "Use one of: tantivy, usearch, flat" in err
    code, out, err = run(capsys, monkeypatch, "index", "--store", store, "--engine", "tantivy", "--json")
    assert code == 0 and json.loads(out)["engines"] == {"terms": "tantivy"}, err
    # no passage retrieved
    code, _, err = run(capsys, monkeypatch, "ask", "zzqx vvbnm", "--store", store)
    assert code == 10 and "No passage matched" in err
    # no store at all
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", tmp_path / "nope")
    assert code == 5 and "cachegraft encode" in err
    # a store made with other models: encode again with another receiver
    code, _, err = run(capsys, monkeypatch, "encode", corpus, "--store", store, "--receiver", tiny_dirs["sharer_same"],
                       "--dtype", "float32", "--codec", "float32")
    assert code == 5 and "receiver" in err
    # sharer-text on a store that ran no sharer needs --sharer
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--system", "sharer-text")
    assert code == 2 and "--sharer" in err
    code, out, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--system", "sharer-text",
                         "--sharer", tiny_dirs["sharer_same"], "--json", "--max-new-tokens", 3)
    assert code == 0 and json.loads(out)["system"] == "sharer-text", err
    # neither a question nor --questions
    code, _, err = run(capsys, monkeypatch, "ask", "--store", store)
    assert code == 2 and "hint:" in err


def test_empty_store_and_changed_receiver(tiny_dirs, tmp_path, capsys, monkeypatch):
    empty = _corpus(tmp_path / "empty.jsonl", [])
    receiver = tmp_path / "receiver"
    shutil.copytree(tiny_dirs["receiver"], receiver)
    code, _, err = run(capsys, monkeypatch, "encode", empty, "--store", tmp_path / "empty-store",
                       "--receiver", receiver)
    assert code == 8 and "no passages" in err and not (tmp_path / "empty-store").exists()  # refused, nothing written
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store.target import Target

    session = ModelSession(ModelChoice(str(receiver), None, "closed", device="cpu", dtype="float32"))
    encode_corpus([], Target.open(str(tmp_path / "empty-store")),
                  session, EncodeOptions(codec="float32"))  # the library may
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", tmp_path / "empty-store")
    assert code == 10 and "no passages" in err
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, receiver)
    run(capsys, monkeypatch, "index", "--store", store)
    shutil.rmtree(receiver)
    shutil.copytree(tiny_dirs["sharer_same"], receiver)  # same path, other weights
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store)
    assert code == 5 and "fingerprint" in err


def test_debug_flag_shows_traceback(tmp_path, capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, "--debug", "ask", "q", "--store", tmp_path / "nope")
    assert code == 5 and "Traceback" in err


def test_adapter_store_answers_as_adapter_without_a_sharer(tiny_dirs, tiny_models, tmp_path, capsys, monkeypatch,
                                                           loads):
    from cachegraft_cli.fuser.checkpoint import save_own

    r, s = tiny_models["receiver"], tiny_models["sharer_same"]
    save_own(open_fuser(r, s, seed=1, width=16, sharer_input="zero"), tmp_path / "adapter")
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"],
            "--sharer", tiny_dirs["sharer_same"], "--fuser", tmp_path / "adapter")
    run(capsys, monkeypatch, "index", "--store", store)
    code, out, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--system", "adapter", "--json",
                         "--max-new-tokens", 4)
    assert code == 0, err
    assert json.loads(out)["system"] == "adapter"
    assert str(tiny_dirs["sharer_same"]) not in loads  # neither encode nor ask ran the sharer
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--system", "graft")
    assert code == 2 and "--system adapter" in err


@pytest.mark.parametrize("order", ["best-last", "retrieval"])
def test_full_recompute_of_own_caches_answers_as_text(tiny_dirs, tmp_path, capsys, monkeypatch, order,
                                                       greedy_margins):
    """Through the CLI at k=3: recomputing every later passage token of the receiver's own
    caches is the text computation, in either passage order (the order applies to text too)."""
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"],
            "--also-own-cache")
    run(capsys, monkeypatch, "index", "--store", store)
    got = {}
    for system, recompute in (("cache", 10_000), ("text", 0), ("cache", 0)):
        code, out, err = run(capsys, monkeypatch, "ask", "who built the lighthouse, signed the treaty, made sugar?",
                             "--store", store, "-k", 3, "--system", system, "--order", order,
                             "--recompute", recompute, "--json", "--max-new-tokens", 10)
        assert code == 0, err
        got[(system, recompute)] = json.loads(out)
    full, text = got[("cache", 10_000)], got[("text", 0)]
    assert min(greedy_margins) >= MIN_GREEDY_MARGIN  # one masked forward vs a plain one: equal up to rounding
    assert full["answer"] == text["answer"] and full["tokens"]["generated"] == text["tokens"]["generated"]
    assert len(full["passages"]) == 3 and full["tokens"]["recomputed"] > 0
    assert got[("cache", 0)]["tokens"]["recomputed"] == 0
    assert full["order"] == order and full["recompute"] == {"tokens": 10_000, "blend": 0.0}


def test_context_window_is_guarded(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"])
    run(capsys, monkeypatch, "index", "--store", store)
    for system in ("graft", "text"):
        code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "--system", system,
                           "--max-new-tokens", 100_000)
        assert code == 2 and "context window of 512" in err and "Traceback" not in err


@pytest.mark.parametrize("args, words", [(["--order", "random"], "passage order"),
                                         (["--recompute", "-1"], "--recompute"),
                                         (["--blend", "2"], "--blend")])
def test_bad_assembly_flags_fail_before_anything_loads(tmp_path, capsys, monkeypatch, args, words):
    code, _, err = run(capsys, monkeypatch, "ask", "q", "--store", tmp_path / "missing", *args)
    assert code == 2 and words in err
