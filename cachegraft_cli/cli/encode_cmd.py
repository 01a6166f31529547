from __future__ import annotations

from typing import Annotated, Optional

import typer

from cachegraft_cli.cli.options import (
    BatchOpt,
    DeviceOpt,
    DtypeOpt,
    FuserOpt,
    InstructionOpt,
    JsonOpt,
    PresetOpt,
    ReceiverOpt,
    SharerOpt,
    StoreOpt,
    TrustOpt,
)
from cachegraft_cli.cli.output import emit_json, log


def encode(
    corpus: Annotated[
        str, typer.Argument(help="JSONL, CSV/TSV, SQuAD JSON, a directory of .txt/.md files, or - for stdin.")
    ],
    store: StoreOpt,
    preset: PresetOpt = None,
    receiver: ReceiverOpt = None,
    sharer: SharerOpt = None,
    fuser: FuserOpt = None,
    codec: Annotated[
        Optional[str],
        typer.Option(help="tc (the transform codec: about 0.12x raw bf16 KV at int4's KL; needs a calibration: "
                     "--calibration, or the one the offline fuser ships), int8 (0.47x, within 1 F1 point of "
                     "lossless, a little faster to load), bf16 (lossless, 0.81x), k8v4 (8-bit keys, 4-bit values: "
                     "0.38x), int4 (0.26x) (default: the store's; for a new one tc where the fuser ships a "
                     "calibration, else int8)."),
    ] = None,
    # Research controls (docs/experiments.md): they cost answer quality or only serve an experiment,
    # so they stay off the help; they work as ever, and `evaluate` variants reach them too.
    keep: Annotated[Optional[float], typer.Option(
        hidden=True, help="Store only this share of each passage's tokens, e.g. 0.5; kept tokens keep their "
                          "positions (default: the store's, 1 = every token for a new one).")] = None,
    keep_by: Annotated[Optional[str], typer.Option(
        hidden=True, help="How --keep chooses tokens: even (evenly spaced, the default), attention (received at "
                          "the receiver's last layers) or norm.")] = None,
    compressor: Annotated[Optional[str], typer.Option(
        help="zstd (smaller) or none (about 40% less writer CPU for 10-20% more bytes: for a writer that "
             "must keep up with a GPU) (default: the store's, zstd for a new one).")] = None,
    mismatched_sharer: Annotated[Optional[bool], typer.Option(
        "--mismatched-sharer/--no-mismatched-sharer", hidden=True,
        help="A control store for `--system mismatched`: the sharer reads another passage of the corpus "
             "(nearest in length, another title) instead of each passage (default: the store's, off for a "
             "new one).")] = None,
    sharer_notes: Annotated[Optional[int], typer.Option(
        min=0, max=1024, hidden=True, help="The sharer writes up to N tokens of notes about each passage (key "
                                           "facts as question-answer pairs); they are stored and fused with it "
                                           "(default: the store's, 0 = none for a new one).")] = None,
    calibration: Annotated[Optional[str], typer.Option(
        help="A new --codec tc store's calibration file (from `cachegraft store calibrate`; default: the one "
             "shipped with the preset's fuser).")] = None,
    batch_size: BatchOpt = 8,
    max_passage_tokens: Annotated[
        int, typer.Option(help="Longer passages are split into chunks (never truncated; at least 16).")
    ] = 512,
    chunk_overlap: Annotated[int, typer.Option(
        help="Tokens each chunk of a split passage repeats from the end of the chunk before, so a fact at a "
             "cut is whole in one chunk (0 to half of --max-passage-tokens).")] = 0,
    also_own_cache: Annotated[
        bool, typer.Option(help="Also store the receiver's own caches (for the `cache` system).")
    ] = False,
    skip_bad: Annotated[bool, typer.Option(help="Skip and count bad input records instead of stopping.")] = False,
    fmt: Annotated[
        Optional[str], typer.Option("--format", help="jsonl, csv, tsv, json or dir (default: by extension).")
    ] = None,
    id_field: Annotated[str, typer.Option(help="Column/field holding the passage id.")] = "id",
    text_field: Annotated[str, typer.Option(help="Column/field holding the passage text.")] = "text",
    title_field: Annotated[str, typer.Option(help="Column/field holding the title.")] = "title",
    commit_every: Annotated[
        int, typer.Option(help="Passages per committed segment (bounds work lost to a crash; at least 1).")
    ] = 2000,
    instruction: InstructionOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    runner: Annotated[str, typer.Option(
        help="local (this process) or ray (actors on a Ray cluster; pip install 'cachegraft[ray]').")] = "local",
    address: Annotated[str | None, typer.Option(
        help="Ray: cluster address HOST:PORT (default: RAY_ADDRESS, else a local Ray runtime).")] = None,
    actors: Annotated[int | None, typer.Option(
        min=1, help="Ray: fusing actors; each loads the models once (default 1).")] = None,
    gpus_per_actor: Annotated[float | None, typer.Option(
        min=0.0, help="Ray: GPUs per actor; 0.5 puts two actors on a GPU (default 0).")] = None,
    cpus_per_actor: Annotated[float | None, typer.Option(
        min=0.01, help="Ray: CPUs per actor, for compressing and writing (default 1).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Encode a corpus into a fused-cache store (idempotent: re-runs skip what is stored)."""
    from cachegraft_cli.api import CorpusSource, EncodeOptions, Models, encode as encode_corpus
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.progress import EncodeProgress

    # Everything is checked before anything is written or any model loads (the API checks the rest).
    options = EncodeOptions(codec=codec, batch_size=batch_size, max_passage_tokens=max_passage_tokens,
                            chunk_overlap=chunk_overlap, also_own_cache=also_own_cache, commit_every=commit_every,
                            keep=keep, keep_by=keep_by,
                            compressor=compressor, mismatched_sharer=mismatched_sharer, sharer_notes=sharer_notes,
                            calibration=calibration)
    models = Models(preset=preset, receiver=receiver, sharer=sharer, fuser=fuser, device=device, dtype=dtype,
                    trust_remote_code=trust_remote_code, instruction=instruction)
    source = CorpusSource(format=fmt, id_field=id_field, text_field=text_field, title_field=title_field,
                          skip_bad=skip_bad)
    ray = _ray_options(runner, address, actors, gpus_per_actor, cpus_per_actor)
    with showing_status(json_out), EncodeProgress(0) as bar:  # the plan sets its total before it shows
        summary = encode_corpus(corpus, store, models=models, options=options, source=source, runner=ray or runner,
                                progress=bar, planned=bar.set_total)
    if summary.fuser == "closed" and summary.added:
        log("note: no fuser (closed): the stored caches are the receiver's own caches.")
    if summary.note and summary.added:
        log(f"note: {summary.note}")
    if json_out:
        emit_json(summary.as_dict())
    else:
        _print(summary)


def _ray_options(runner: str, address, actors, gpus_per_actor, cpus_per_actor):
    """None for the local runner (Ray flags refused there); Ray's options otherwise."""
    from cachegraft_cli.errors import UsageError

    given = {"--address": address, "--actors": actors, "--gpus-per-actor": gpus_per_actor,
             "--cpus-per-actor": cpus_per_actor}
    if runner != "ray":
        flags = [flag for flag, value in given.items() if value is not None]
        if flags:
            raise UsageError(f"{', '.join(flags)} only apply with --runner ray.", "Add --runner ray, or drop them.")
        return None
    from cachegraft_cli.encoding.ray.driver import RayOptions

    return RayOptions(address=address, actors=actors or 1, gpus_per_actor=gpus_per_actor or 0.0,
                      cpus_per_actor=cpus_per_actor or 1.0)


def _print(s) -> None:
    typer.echo(
        f"{s.store}: added {s.added} passages ({s.tokens:,} tokens, {s.bytes:,} bytes, {s.bytes_per_token:,.0f} "
        "B/token), "
        f"skipped {s.skipped_existing} already stored, {s.skipped_bad} bad; {s.chunks_split} extra chunks from long "
        f"passages; {s.seconds:.1f} s."
    )
