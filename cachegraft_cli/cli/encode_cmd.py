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
        Optional[str], typer.Option(help="bf16 (lossless), int8 or int4 (default: the store's, bf16 for a new one).")
    ] = None,
    batch_size: BatchOpt = 8,
    max_passage_tokens: Annotated[
        int, typer.Option(min=16, help="Longer passages are split into chunks (never truncated).")
    ] = 512,
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
        int, typer.Option(min=1, help="Passages per committed segment (bounds work lost to a crash).")
    ] = 2000,
    instruction: InstructionOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Encode a corpus into a fused-cache store (idempotent: re-runs skip what is stored)."""
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encode import EncodeOptions, encode_into
    from cachegraft_cli.progress import EncodeProgress

    options = EncodeOptions(codec, batch_size, max_passage_tokens, also_own_cache, commit_every)
    reader = read_corpus(corpus, id_field=id_field, text_field=text_field, title_field=title_field,
                         skip_bad=skip_bad, format=fmt)
    passages = list(reader)  # read and check everything before any model loads or anything is written
    with showing_status(json_out), EncodeProgress(len(passages)) as bar:
        summary = encode_into(store, passages, options, preset=preset, receiver=receiver, sharer=sharer, fuser=fuser,
                              device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                              instruction=instruction, progress=bar)
    if summary.fuser == "closed" and summary.added:
        log("note: no fuser (closed): the stored caches are the receiver's own caches.")
    summary.skipped_bad = sum(reader.skipped.values())
    summary.skipped_reasons = dict(reader.skipped)
    if json_out:
        emit_json(summary.as_dict())
    else:
        _print(summary)


def _print(s) -> None:
    typer.echo(
        f"{s.store}: added {s.added} passages ({s.tokens:,} tokens, {s.bytes:,} bytes, {s.bytes_per_token:,.0f} "
        "B/token), "
        f"skipped {s.skipped_existing} already stored, {s.skipped_bad} bad; {s.chunks_split} extra chunks from long "
        f"passages; {s.seconds:.1f} s."
    )
