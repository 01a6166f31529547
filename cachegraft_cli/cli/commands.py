"""Where each command module is attached to the app, in help order. The command modules
import only typer at load time (their heavy imports are inside the functions)."""

from __future__ import annotations

from typing import Callable

import typer

from cachegraft_cli.cli.ask_cmd import ask
from cachegraft_cli.cli.encode_cmd import encode
from cachegraft_cli.cli.evaluate_cmd import evaluate
from cachegraft_cli.cli.fuser_cmd import fuser_app
from cachegraft_cli.cli.index_cmd import index
from cachegraft_cli.cli.models_cmd import models_app
from cachegraft_cli.cli.serve_cmd import serve
from cachegraft_cli.cli.store_cmd import store_app
from cachegraft_cli.cli.train_cmd import train_fuser

_COMMANDS: list[tuple[str, Callable[..., None]]] = [
    ("encode", encode), ("index", index), ("ask", ask), ("serve", serve), ("evaluate", evaluate),
    ("train-fuser", train_fuser),
]
_GROUPS = [fuser_app, store_app, models_app]


def register(app: typer.Typer) -> None:
    # A given short help is wrapped at the terminal width; a derived one is cut with "...".
    for name, function in _COMMANDS:
        app.command(name=name, help=function.__doc__, short_help=function.__doc__)(function)
    for group in _GROUPS:
        app.add_typer(group, short_help=group.info.help)
