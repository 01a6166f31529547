"""`encode --engine`: bad engine options fail at once, before the corpus is read or anything loads."""

from __future__ import annotations

import sys

import pytest

from cachegraft_cli.cli.app import main


def run(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["cachegraft", *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main()
    return info.value.code or 0, capsys.readouterr().err


@pytest.mark.parametrize("args, code, message", [
    (["--actors", "2"], 2, "--actors only apply with --engine ray"),
    (["--engine", "local", "--address", "h:1", "--gpus-per-actor", "1"], 2, "--address, --gpus-per-actor only apply"),
    (["--engine", "spark"], 2, "unknown --engine 'spark'"),
    (["--engine", "ray", "--address", "nonsense"], 2, "is not HOST:PORT"),
    (["--engine", "ray", "--gpus-per-actor", "1", "--device", "cpu"], 2, "asks for GPUs, but --device is cpu"),
])
def test_bad_engine_options_fail_before_anything_loads(capsys, monkeypatch, tmp_path, args, code, message):
    missing = tmp_path / "no-such-corpus.jsonl"  # never read: the options fail first
    got, err = run(capsys, monkeypatch, "encode", missing, "--store", tmp_path / "s", *args)
    assert got == code and message in err and "hint:" in err
    assert not (tmp_path / "s").exists()


def test_missing_ray_says_what_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    got, err = run(capsys, monkeypatch, "encode", tmp_path / "c.jsonl", "--store", tmp_path / "s", "--engine", "ray")
    assert got == 2 and "needs Ray, which is not installed" in err and "cachegraft[ray]" in err


def test_an_address_nobody_listens_at_fails_in_seconds():
    import socket

    from cachegraft_cli.engines.ray_engine import _probe
    from cachegraft_cli.errors import EngineError

    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(EngineError, match=f"no Ray cluster answers at 127.0.0.1:{port}"):
        _probe(f"127.0.0.1:{port}", timeout=2)
    _probe(None)  # no address: Ray starts a local runtime
    _probe("auto")
