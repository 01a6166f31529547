"""`cachegraft store info|verify|repair|compact|calibrate|unlock DIR`: inspect, check, repair, compact a store."""

from __future__ import annotations

from typing import Annotated

import typer

from cachegraft_cli.cli.options import JsonOpt

store_app = typer.Typer(
    name="store", help="Inspect, verify, repair, compact or unlock a cache store.", no_args_is_help=True,
    rich_markup_mode=None,
)

DirArg = Annotated[str, typer.Argument(help="Store directory or fsspec URL (e.g. s3://bucket/store).", metavar="DIR")]


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _model(spec) -> str:
    if not spec:
        return "none"
    if isinstance(spec, dict):
        pin = spec.get("revision") or spec.get("sha256") or ""
        return f"{spec.get('name', '?')}" + (f" @ {str(pin)[:12]}" if pin else "")
    return str(spec)


def _keep_rows(table, report: dict) -> None:
    """What pruning keeps, and every passage token's stored bytes against raw bf16 KV."""
    keep = report.get("keep")
    if keep is not None:
        table.add_row("keep", f"{keep['ratio']:g} of each passage's tokens (by {keep['by']}); "
                              f"{report['tokens']:,} of {report['passage_tokens']:,} tokens stored")
    for kind, ratio in report.get("ratio_to_raw_bf16_full", {}).items():
        if ratio is not None:
            table.add_row(f"stored / raw {kind}", f"{ratio:.3f} x raw bf16 KV of every passage token "
                                                  f"({1 / ratio:.1f}x smaller)" if ratio else "-")


def _info_table(report: dict):
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    g = report["geometry"]
    for role, spec in report["models"].items():
        table.add_row(role, _model(spec))
    table.add_row("geometry", f"{g['layers']} layers x {g['kv_heads']} kv heads x {g['head_dim']} head dim")
    table.add_row("codec", f"{report['codec']} {report['codec_params'] or ''}".strip())
    table.add_row("kinds", ", ".join(report["kinds"]))
    table.add_row("passages", f"{report['passages']:,} ({report['rows']:,} rows)")
    table.add_row("tokens", f"{report['tokens']:,} (+{report['prefix_tokens']} prefix)")
    table.add_row("bytes", _fmt_bytes(report["bytes"]["total"]))
    for kind, bpt in report["bytes_per_token"].items():
        ratio = report["ratio_to_raw_bf16"][kind]
        text = (
            "-"
            if bpt is None
            else f"{bpt:,.0f} B ({ratio:.3f} x raw bf16; nominal {report['nominal_bytes_per_token']:,.0f} B)"
        )
        table.add_row(f"bytes/token {kind}", text)
    _keep_rows(table, report)
    tables = report.get("codec_tables")
    if tables:
        table.add_row("codec tables", f"{_fmt_bytes(tables['bytes'])} once per store ({tables['file']}): calibrated "
                                      f"on {tables['tokens']:,} tokens of {tables['source']}, key step "
                                      f"{tables['key_step']:g}, value step {tables['value_step']:g}"
                                      + (", weighted by the receiver" if tables.get("weighting") else "")
                                      + (", per-layer steps" if tables.get("layer_steps") else ""))
    table.add_row("segments", str(report["segments"]["count"]))
    for seg in report["segments"]["list"]:
        table.add_row("", f"{seg['name']}: {seg['rows']:,} rows, {seg['tokens']:,} tokens, committed "
                          f"{seg['committed']}")
    table.add_row("index", _index_text(report.get("index"), report["url"]))
    if report.get("quarantine"):
        table.add_row("quarantine", f"{len(report['quarantine'])} repairs keep what they took out in "
                      f"{report['url']}/quarantine/ (undo one with `cachegraft store repair DIR --undo ID`): "
                      + ", ".join(report["quarantine"]))
    if report["writer"]:
        w = report["writer"]
        table.add_row("writer", f"pid {w.get('pid')} on {w.get('host')} since {w.get('since')}")
    return table


def _index_text(index: dict | None, url: str) -> str:
    if index is None:
        return f"none (build it with `cachegraft index --store {url}`)"
    if index.get("kind") is None:
        return f"unreadable: {index['problem']}"
    model = f" ({index['embedder']})" if index.get("embedder") else ""
    state = f"stale: run `cachegraft index --store {url}` to add the new passages" if index["stale"] else "up to date"
    return f"{index['kind']}{model}, {index['passages']:,} passages, {_fmt_bytes(index['bytes'])}; {state}"


@store_app.command("info")
def info(store: DirArg, json: JsonOpt = False) -> None:
    """Geometry, models, codec, passages, tokens, bytes, segments and retrieval index of a store."""
    from cachegraft_cli.cli.output import emit_json, stdout_console
    from cachegraft_cli.retrieval.stored import store_report

    report = store_report(store)
    if json:
        emit_json(report)
        return
    console = stdout_console()
    console.print(f"[bold]{report['url']}[/bold]")
    console.print(_info_table(report))


@store_app.command("verify")
def verify(
    store: DirArg,
    fix: Annotated[bool, typer.Option("--fix", help="Repair what is found (as `cachegraft store repair`).")] = False,
    reencode: Annotated[bool, typer.Option("--reencode", help="With --fix: encode dropped passages again.")] = False,
    json: JsonOpt = False,
) -> None:
    """Check that every chunk decodes, every passage matches its checksums and the index serves the store."""
    from cachegraft_cli.cli.output import emit_json, log
    from cachegraft_cli.errors import StoreCorruptError, StoreMetadataError, UsageError
    from cachegraft_cli.maintenance import verify_store

    if reencode and not fix:
        raise UsageError("--reencode only goes with --fix.", f"Run `cachegraft store verify {store} --fix --reencode`.")
    try:
        report = verify_store(store, progress=_progress())
    except StoreCorruptError:  # e.g. a lost manifest: the store does not open, repair rebuilds it
        if not fix:
            raise
        _repair(store, reencode, json)
        return
    if json and not fix:
        emit_json(report)
    elif not json:
        log(f"checked {report['rows']:,} rows, {report['tokens']:,} tokens in {report['segments']} segments")
        for p in report["problems"]:
            log(f"  {_where(p)}: {p['problem']}")
        for note in report.get("notes", []):
            log(f"  note: {note}")
    if not report["ok"] and fix:
        _repair(store, reencode, json)
        return
    if not report["ok"]:
        first = report["problems"][0]
        if first["code"] == "metadata" and first["segment"] is None:
            raise StoreMetadataError(f"{report['url']}: {first['problem']}",
                                     hint="Restore the file from a backup: it cannot be re-derived, and no passage "
                                          "of the store decodes without it.")
        if all(p["code"] == "control_tokens" for p in report["problems"]):
            raise StoreCorruptError(
                f"{len(report['problems'])} passage(s) of {report['url']} were cached with control tokens parsed "
                f"from their text; first: {_where(first)}.",
                hint=f"Run `cachegraft store repair {store} --reencode`: it encodes them again with their text read "
                     "as plain text (what it takes out is kept in the quarantine, and it can be undone).")
        raise StoreCorruptError(
            f"{len(report['problems'])} problem(s) in {report['url']}; first: {_where(first)}: "
            f"{first['problem'].rstrip('.')}.",
            hint=f"Run `cachegraft store repair {store}`: it drops only rows proven unreadable, keeps what it "
                 f"cannot judge in {store}/quarantine/, and can be undone (--reencode encodes dropped passages again).")
    if not json:
        typer.echo("ok")


def _where(p: dict) -> str:
    if p.get("segment") is None:
        return "codec tables" if p.get("code") == "metadata" else "index"
    if p.get("passage") is None:
        return f"segment {p['segment']}"
    return f"segment {p['segment']}, passage {p['passage']!r}" + (f", {p['kind']}/{p['part']}" if p.get("kind") else "")


@store_app.command("repair")
def repair(
    store: DirArg,
    reencode: Annotated[
        bool, typer.Option("--reencode", help="Encode dropped passages again (loads the store's models).")
    ] = False,
    undo: Annotated[str | None, typer.Option(
        "--undo", metavar="ID", help="Undo an earlier repair: its id under DIR/quarantine/ (it printed it).")] = None,
    json: JsonOpt = False,
) -> None:
    """Rebuild a lost manifest, drop rows proven damaged (or encode them again), fix the index; nothing is
    deleted: what is taken out goes to DIR/quarantine/<id>/, and `--undo ID` puts it back."""
    if undo is not None:
        _undo(store, undo, reencode, json)
        return
    _repair(store, reencode, json)


def _undo(store: str, repair_id: str, reencode: bool, json_out: bool) -> None:
    from cachegraft_cli.cli.output import emit_json, log
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.maintenance import undo_repair

    if reencode:
        raise UsageError("--undo does not go with --reencode.", f"Run `cachegraft store repair {store} --undo "
                         f"{repair_id}` alone.")
    lines = undo_repair(store, repair_id)
    if json_out:
        emit_json({"url": store, "undone": repair_id, "lines": lines})
        return
    for line in lines:
        log(line)
    typer.echo(f"undone: {repair_id}")


def _repair(store: str, reencode: bool, json_out: bool) -> None:
    from cachegraft_cli.cli.output import emit_json, log
    from cachegraft_cli.errors import StoreCorruptError
    from cachegraft_cli.maintenance import repair_store

    result = repair_store(store, reencode)
    if json_out:
        emit_json(result)
    else:
        for line in result["lines"]:
            log(line)
    if not result["ok"]:
        first = result["problems_left"][0]
        raise StoreCorruptError(f"{len(result['problems_left'])} problem(s) are left in {store} after repair; first: "
                                f"{_where(first)}: {first['problem'].rstrip('.')}.",
                                hint="Restore the store from a backup, or encode the corpus into a new --store.")
    if not json_out:
        typer.echo("repaired" if result["lines"] else "ok (nothing to repair)")


def _progress():
    import sys

    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int) -> None:
        sys.stderr.write(f"\rverifying {done:,}/{total:,} tokens")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


@store_app.command("calibrate")
def calibrate(
    store: DirArg,
    out: Annotated[str, typer.Option("--out", "-o", help="Where to write the calibration (.safetensors).")],
    key_step: Annotated[float, typer.Option(
        min=0.01, max=8.0, help="Keys' quantiser step, in units of each layer's RMS spread (smaller: finer, larger "
                                "stores).")] = 0.25,
    value_step: Annotated[float, typer.Option(min=0.01, max=8.0, help="The values' step, likewise.")] = 0.35,
    ratio: Annotated[float | None, typer.Option(
        min=0.01, max=0.5, help="Scale both steps (keeping their proportion) so the calibration codes its own "
                                "passages at this share of raw bf16, e.g. 0.1 (other passages cost more).")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        min=1000, help="Calibrate on the store's first passages up to this many tokens (default: 50,000, fewer "
                       "where their float32 caches would pass 1.5 GB).")] = None,
    weighting: Annotated[bool, typer.Option(
        "--weighting/--no-weighting", help="Shape the error by what it costs the store's receiver (its queries "
                                           "and output projections; loads the receiver): about half the KL at "
                                           "the same bytes. --no-weighting fits without any model.")] = True,
    layer_steps: Annotated[bool, typer.Option(
        "--layer-steps/--uniform-steps", help="Take the per-layer step multipliers measured for this receiver, "
                                              "where the store's fuser ships a calibration that records them.")] = True,
    json: JsonOpt = False,
) -> None:
    """Fit a transform-codec calibration on a store's caches, for `encode --codec tc --calibration FILE`."""
    from pathlib import Path

    from cachegraft_cli.cli.output import emit_json
    from cachegraft_cli.encoding.calibration import fit_from_store
    from cachegraft_cli.store import transform as tf

    target = Path(out).expanduser()
    if not target.parent.is_dir():
        from cachegraft_cli.errors import UsageError

        raise UsageError(f"the directory of {str(target)!r} does not exist.", "Create it, or write elsewhere.")
    from cachegraft_cli.cli.output import showing_status

    settings = tf.FitOptions(key_step=key_step, value_step=value_step)
    with showing_status(json):
        cal, tokens = fit_from_store(store, settings, max_tokens, ratio, weighted=weighting, layer_steps=layer_steps)
    key_step, value_step = cal.info["key_step"], cal.info["value_step"]
    target.write_bytes(cal.to_bytes())
    bits = cal.info["bits_per_element"]
    report = {"out": str(target), "tokens": tokens, "bytes": len(cal.to_bytes()), "sha256": cal.sha256,
              "key_step": key_step, "value_step": value_step, "rope_theta": cal.info["rope_theta"],
              "bits_per_element": bits, "ratio_to_raw_bf16": round(bits / 16, 4),
              "weighting": cal.info["weighting"], "layer_steps": cal.info["layer_steps"] is not None}
    if json:
        emit_json(report)
        return
    typer.echo(f"{target}: calibrated on {tokens:,} tokens of {store} ({report['bytes']:,} bytes). On those "
               f"passages it codes {bits:.2f} bits per element, {bits / 16:.3f}x raw bf16 (others cost more: "
               f"`store info` shows what a store holds). Encode with --codec tc --calibration {target}")


@store_app.command("unlock")
def unlock(
    store: DirArg,
    force: Annotated[bool, typer.Option("--force", help="Remove a lock held from another host.")] = False,
) -> None:
    """Remove a stale writer lock left by a dead writer (refused while the writer lives)."""
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.location import Location
    from cachegraft_cli.store.lock import unlock as do_unlock

    CacheStore.check_exists(store)  # a missing store fails with its usual hint
    loc = Location.from_url(store)
    typer.echo(do_unlock(loc, force=force))
    index_lock = "index/lock"
    if loc.exists(index_lock) and not loc.local:  # a killed `cachegraft index` on an object store
        typer.echo(f"index: {do_unlock(loc, force=force, name=index_lock)}")


@store_app.command("compact")
def compact(
    store: DirArg,
    target_bytes: Annotated[int, typer.Option(
        min=1, help="Merge runs of segments under half this size until one holds this many bytes.")] = 1 << 30,
    grace: Annotated[float, typer.Option(
        min=0.0, help="Seconds replaced segments stay for readers that opened before.")] = 3600.0,
    json: JsonOpt = False,
) -> None:
    """Merge small segments into larger ones; cache bytes and checksums stay the same (safe to interrupt)."""
    from cachegraft_cli.cli.output import emit_json
    from cachegraft_cli.store.compact import CompactOptions, compact as do_compact

    report = do_compact(store, CompactOptions(target_bytes=target_bytes, grace_seconds=grace))
    if json:
        emit_json(report)
        return
    rows = sum(m["rows"] for m in report["merged"])
    typer.echo(f"{report['url']}: {report['segments_before']} -> {report['segments_after']} segments "
               f"({len(report['merged'])} merged, {rows:,} rows moved); deleted {len(report['retired_deleted'])} "
               f"retired segments; {report['seconds']:.1f} s.")
