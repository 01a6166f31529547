"""Where each command module is attached to the app, in help order."""

from __future__ import annotations

import importlib

import typer

# (module under cachegraft_cli.cli, attribute, kind): kind "cmd" is a function, "group" a Typer app.
_COMMANDS = [
    ("encode_cmd", "encode", "cmd"),
    ("index_cmd", "index", "cmd"),
    ("ask_cmd", "ask", "cmd"),
    ("evaluate_cmd", "evaluate", "cmd"),
    ("fuser_cmd", "fuser_app", "group"),
    ("train_cmd", "train_fuser", "cmd"),
    ("store_cmd", "store_app", "group"),
    ("models_cmd", "models_app", "group"),
]


def register(app: typer.Typer) -> None:
    for module_name, attr, kind in _COMMANDS:
        module = importlib.import_module(f"cachegraft_cli.cli.{module_name}")
        target = getattr(module, attr)
        if kind == "group":
            app.add_typer(target)
        else:
            app.command(name=attr.replace("_", "-"), help=target.__doc__)(target)
