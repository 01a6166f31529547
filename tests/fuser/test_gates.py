"""`cachegraft fuser info --gates` (evaluation/gates.py): per layer, shut gates add exactly
nothing, open ones move the KV by an amount that depends on what the sharer read; an adapter
has no sharer dependence; bad options are refused before any model loads."""

import json

import pytest
from cli_support import PASSAGES, run_cli
from tiny import open_fuser


def _fuser_dir(tiny_models, path, logit: float, sharer_input: str = "model") -> str:
    from cachegraft_cli.fuser.checkpoint import save_published

    fuser = open_fuser(tiny_models["receiver"], tiny_models["sharer_same"], seed=2, sharer_input=sharer_input)
    fuser.set_gates(logit)
    save_published(fuser, path)
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    return path


def _report(capsys, monkeypatch, tiny_dirs, fuser, corpus, *extra):
    code, out, err = run_cli(capsys, monkeypatch, "fuser", "info", fuser, "--gates", "--corpus", corpus,
                             "--receiver", tiny_dirs["receiver"], "--sharer", tiny_dirs["sharer_same"],
                             "--dtype", "float32", "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_open_gates_move_the_kv_by_what_the_sharer_read(tiny_models, tiny_dirs, corpus, tmp_path, capsys,
                                                        monkeypatch):
    report = _report(capsys, monkeypatch, tiny_dirs, _fuser_dir(tiny_models, tmp_path / "open", 1.0), corpus)
    assert report["passages"] == 3 and len(report["layers"]) == tiny_models["receiver"].geometry.layers
    for row in report["layers"]:
        assert row["key_gate"] and row["value_gate"]
        for part in ("key", "value"):
            assert row[part]["residual"] > 0 and row[part]["sharer_dependence"] > 0


def test_shut_gates_add_exactly_nothing(tiny_models, tiny_dirs, corpus, tmp_path, capsys, monkeypatch):
    report = _report(capsys, monkeypatch, tiny_dirs, _fuser_dir(tiny_models, tmp_path / "shut", -1.0), corpus)
    assert all(not row["key_gate"] and row["key"]["residual"] == row["value"]["residual"] == 0
               for row in report["layers"])


def test_an_adapter_has_no_sharer_dependence(tiny_models, tiny_dirs, corpus, tmp_path, capsys, monkeypatch):
    adapter = _fuser_dir(tiny_models, tmp_path / "adapter", 1.0, sharer_input="zero")
    report = _report(capsys, monkeypatch, tiny_dirs, adapter, corpus, "--limit", 2)
    assert report["passages"] == 2
    assert all(row["value"]["residual"] > 0 and row["value"]["sharer_dependence"] is None for row in report["layers"])


@pytest.mark.parametrize("extra, message", [
    ((), "--corpus"),
    (("--corpus", "CORPUS", "--limit", "1"), "limit"),
    (("--corpus", "missing.jsonl"), "missing.jsonl"),
    (("--corpus", "CORPUS", "--dtype", "int3"), "dtype"),
])
def test_bad_options_are_refused_before_any_model_loads(tiny_models, tiny_dirs, corpus, tmp_path, capsys,
                                                        monkeypatch, extra, message, loads):
    fuser = _fuser_dir(tiny_models, tmp_path / "f", 1.0)
    args = [str(corpus) if a == "CORPUS" else a for a in extra]
    code, _, err = run_cli(capsys, monkeypatch, "fuser", "info", fuser, "--gates", "--receiver", tiny_dirs["receiver"],
                           *args)
    assert code != 0 and message in err and not loads


def test_a_fuser_no_preset_ships_needs_its_models_named(tiny_models, corpus, tmp_path, capsys, monkeypatch):
    code, _, err = run_cli(capsys, monkeypatch, "fuser", "info", _fuser_dir(tiny_models, tmp_path / "f", 1.0),
                           "--gates", "--corpus", corpus)
    assert code == 2 and "--receiver and --sharer" in err
