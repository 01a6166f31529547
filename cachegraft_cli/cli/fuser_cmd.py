from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cachegraft_cli.cli.options import DeviceOpt, DtypeOpt, JsonOpt, PresetOpt, ReceiverOpt, SharerOpt
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
    gates: Annotated[bool, typer.Option("--gates", help="Per layer: the gates, how far the fused KV moves from "
                                        "the receiver's own (residual), and how much of that move depends on what "
                                        "the sharer read (runs both models over --corpus).")] = False,
    corpus: Annotated[Optional[str], typer.Option(help="With --gates: passages to run (a corpus file as encode "
                                                  "reads it).")] = None,
    limit: Annotated[int, typer.Option(help="With --gates: passages of --corpus to run (at least 2).")] = 32,
    preset: PresetOpt = None,
    receiver: ReceiverOpt = None,
    sharer: SharerOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show a fuser's pair, layer map, projector shape and gate states; with --gates, what each layer does."""
    from cachegraft_cli.fuser import check_fuser_spec, load_fuser

    check_fuser_spec(spec)
    if gates:
        _gates(spec, corpus, limit, preset, receiver, sharer, device, dtype, json_out)
        return
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


def _gates(spec: str, corpus: str | None, limit: int, preset, receiver, sharer, device, dtype, json_out: bool) -> None:
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.evaluation.gates import inspect_gates

    if corpus is None:
        raise UsageError("--gates runs the fuser over passages, and none were given.",
                         "Add --corpus FILE (e.g. sample_data/corpus.jsonl).")
    with showing_status(json_out):
        report = inspect_gates(spec, corpus, limit=limit, preset=preset, receiver=receiver, sharer=sharer,
                               device=device, dtype=dtype)
    if json_out:
        emit_json(report)
        return
    typer.echo(f"{report['fuser']}: {report['passages']} passages, {report['tokens']} tokens")
    typer.echo("layer  gates(k/v)  residual k / v     sharer dependence k / v")
    for row in report["layers"]:
        gate = f"{'open' if row['key_gate'] else 'shut'}/{'open' if row['value_gate'] else 'shut'}"
        dep = [row[part]["sharer_dependence"] for part in ("key", "value")]
        shown = " / ".join("-" if d is None else f"{d:.3f}" for d in dep)
        typer.echo(f"{row['layer']:5}  {gate:10}  {row['key']['residual']:.3f} / {row['value']['residual']:.3f}"
                   f"     {shown}")


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
