"""The `cachegraft` command. Sub-command modules import only typer at load time,
so `cachegraft --help` never imports torch or transformers."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cachegraft_cli import __version__
from cachegraft_cli.cli.errors import handled, set_debug

app = typer.Typer(
    name="cachegraft",
    help="RAG where knowledge travels as fused KV caches: encode a corpus once, answer with the small model only.",
    no_args_is_help=True, rich_markup_mode=None,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cachegraft {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks on errors.", envvar="CACHEGRAFT_DEBUG")
    ] = False,
) -> None:
    set_debug(debug)


def _register() -> None:
    from cachegraft_cli.cli import commands

    commands.register(app)


_register()


def main() -> None:
    """The console script. Click runs without its own error display (standalone_mode=False), so
    usage errors go through the one error map (`cli/errors.py`) like every other failure."""
    with handled():
        code = app(standalone_mode=False)
    raise SystemExit(code if isinstance(code, int) else 0)
