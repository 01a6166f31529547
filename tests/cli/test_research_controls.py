"""Research controls stay off the first screen: `encode --help` and `ask --help` (and `serve --help`)
name none of them, while every one is still accepted and works (docs/experiments.md)."""

from __future__ import annotations

import json

import pytest
from cli_support import PASSAGES, QUESTIONS, run_cli
from typer.main import get_command
from typer.testing import CliRunner

from cachegraft_cli.cli.app import app

HIDDEN = {
    "encode": ("--keep", "--keep-by", "--mismatched-sharer", "--no-mismatched-sharer", "--sharer-notes",
               "k2v4", "int2"),
    "ask": ("--blend", "--blend-layer", "k2v4", "int2"),
    "serve": ("--blend", "--blend-layer"),
}
SHOWN = {  # what the same screens still show, so an empty or failed help cannot pass
    "encode": ("--codec", "int8", "bf16", "k8v4", "int4", "tc (the transform codec", "--compressor", "--calibration"),
    "ask": ("--recompute", "--order", "--scheme", "--system"),
    "serve": ("--recompute", "--order"),
}


@pytest.mark.parametrize("command", sorted(HIDDEN))
def test_help_names_no_research_control(command):
    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    words = result.output.replace(",", " ").replace("(", " ").replace(")", " ").split()
    for name in HIDDEN[command]:
        assert name not in words and f"{name}=" not in result.output, f"{command} --help shows {name}"
    for name in ("--keep ", "--blend "):
        assert name not in result.output
    flat = " ".join(result.output.split())  # help lines rewrapped as one
    for text in SHOWN[command]:
        assert text in flat, f"{command} --help lost {text}"


def _params(command: str, args: list[str]) -> dict:
    """The parameters click parses from `cachegraft COMMAND ARGS` (nothing runs)."""
    group = get_command(app)
    cmd = group.commands[command]  # type: ignore[attr-defined]  # a TyperGroup
    return cmd.make_context(command, args).params


def test_hidden_options_are_still_parsed():
    encode = _params("encode", ["c.jsonl", "--store", "s", "--keep", "0.5", "--keep-by", "attention",
                                "--mismatched-sharer", "--sharer-notes", "48", "--codec", "k2v4"])
    assert (encode["keep"], encode["keep_by"], encode["mismatched_sharer"], encode["sharer_notes"],
            encode["codec"]) == (0.5, "attention", True, 48, "k2v4")
    assert _params("encode", ["c.jsonl", "--store", "s", "--no-mismatched-sharer", "--codec", "int2"])[
        "mismatched_sharer"] is False
    ask = _params("ask", ["q?", "--store", "s", "--blend", "0.15", "--blend-layer", "2"])
    assert (ask["blend"], ask["blend_layer"]) == (0.15, 2)
    serve = _params("serve", ["--store", "s", "--blend", "0.15", "--blend-layer", "2"])
    assert (serve["blend"], serve["blend_layer"]) == (0.15, 2)


def test_hidden_options_still_work_end_to_end(tiny_dirs, tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    store = tmp_path / "store"
    code, out, err = run_cli(capsys, monkeypatch, "encode", corpus, "--store", store, "--receiver",
                             tiny_dirs["receiver"], "--fuser", "closed", "--device", "cpu", "--dtype", "float32",
                             "--codec", "int2", "--keep", "0.5", "--keep-by", "even", "--no-mismatched-sharer",
                             "--sharer-notes", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["added"] == len(PASSAGES)
    code, out, err = run_cli(capsys, monkeypatch, "store", "info", store, "--json")
    report = json.loads(out)
    assert code == 0 and report["codec"] == "int2" and report["keep"] == {"ratio": 0.5, "by": "even"}
    assert run_cli(capsys, monkeypatch, "index", "--store", store)[0] == 0
    code, out, err = run_cli(capsys, monkeypatch, "ask", QUESTIONS[0], "--store", store, "-k", "2", "--blend",
                             "0.5", "--blend-layer", "1", "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["k"] == 2
