"""Invoking `cachegraft` in-process through main(), so tests see the real error mapping."""

from __future__ import annotations

import sys

import pytest

from cachegraft_cli.cli.app import main


def run_cli(capsys, monkeypatch, *args, forbid: tuple[str, ...] = ("Traceback",)) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cachegraft ARGS`; stderr must hold none of `forbid`."""
    monkeypatch.setattr(sys, "argv", ["cachegraft", *map(str, args)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main()
    out, err = capsys.readouterr()
    for text in forbid:
        assert text not in err, err
    return info.value.code or 0, out, err
