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


# Three passages with one question each: the corpus the CLI and server tests encode.
PASSAGES = [
    {"id": "harbor", "title": "Harbor town",
     "text": "Harbor town was founded in 1820 by fishermen who built the first lighthouse."},
    {"id": "treaty", "title": "Treaty",
     "text": "The treaty was signed in Vienna after long talks between the two empires."},
    {"id": "photo", "title": "Photosynthesis",
     "text": "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen."},
]
QUESTIONS = ["who built the lighthouse?", "where was the treaty signed?", "what does photosynthesis make?"]
