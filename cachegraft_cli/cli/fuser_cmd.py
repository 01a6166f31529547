from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cachegraft_cli.cli.options import JsonOpt
from cachegraft_cli.cli.output import emit_json

fuser_app = typer.Typer(
    name="fuser",
    help="Inspect fuser checkpoints and convert between layouts.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@fuser_app.command("info")
def info(
    spec: Annotated[str, typer.Argument(help="Local dir, REPO:SUBFOLDER on the hub, or builtin:<name>.")],
    json_out: JsonOpt = False,
) -> None:
    """Show a fuser's pair, layer map, projector shape and gate states."""
    from cachegraft_cli.fuser import check_fuser_spec, load_fuser

    check_fuser_spec(spec)
    summary = _summary(spec, load_fuser(spec))
    if json_out:
        emit_json(summary)
        return
    for key in (
        "receiver",
        "sharer",
        "alignment",
        "projectors",
        "parameters",
        "hidden_dim",
        "open_gates",
        "fingerprint",
    ):
        typer.echo(f"{key:12} {summary[key]}")


def _summary(spec: str, fuser) -> dict:
    from cachegraft_cli.errors import UsageError

    if fuser is None:
        raise UsageError("'closed' is not a checkpoint.", "Give a fuser directory or hub folder.")
    gates = fuser.gate_states()
    return {
        "spec": spec,
        "receiver": fuser.spec.receiver,
        "sharer": fuser.spec.sharer,
        "alignment": fuser.spec.alignment_strategy if fuser.spec.alignment else "none",
        "projectors": len(fuser.projectors),
        "parameters": sum(p.numel() for p in fuser.parameters()),
        "hidden_dim": fuser.projectors[0].args.hidden_dim,
        "open_gates": f"{sum(g['key'] for g in gates)} key / {sum(g['value'] for g in gates)} value of {len(gates)}",
        "layer_map": {str(t): pairs for t, pairs in sorted(fuser.spec.layer_map.items())},
        "gates": gates,
        "fingerprint": fuser.fingerprint()[:32],
    }


@fuser_app.command("convert")
def convert(
    src: Annotated[str, typer.Argument(help="Fuser to read (any layout or spec).")],
    dst: Annotated[Path, typer.Argument(help="Directory to write.")],
    to: Annotated[str, typer.Option(help="own (safetensors + JSON) or published (C2C layout).")] = "own",
) -> None:
    """Convert a fuser between the published C2C layout and CacheGraft's own format."""
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.fuser import resolve_fuser_dir
    from cachegraft_cli.fuser.checkpoint import convert as convert_checkpoint

    if to not in ("own", "published"):
        raise UsageError(f"Unknown layout {to!r}.", "Use --to own or --to published.")
    path = convert_checkpoint(resolve_fuser_dir(src), dst, to)
    typer.echo(str(path))
