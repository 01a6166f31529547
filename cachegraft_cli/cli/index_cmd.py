from __future__ import annotations

from typing import Annotated

import typer

from cachegraft_cli.cli.options import JsonOpt, StoreOpt
from cachegraft_cli.cli.output import emit_json


def index(
    store: StoreOpt,
    kind: Annotated[str, typer.Option(help="bm25 (default, no model), dense, or hybrid.")] = "bm25",
    embedder: Annotated[
        str | None, typer.Option(help="Sentence-transformers model for dense/hybrid: hub id or local directory.")
    ] = None,
    rebuild: Annotated[bool, typer.Option(help="Rebuild from scratch instead of adding new passages.")] = False,
    engine: Annotated[
        list[str] | None,
        typer.Option("--engine", help="Search engine for a part of the kind (repeatable): tantivy (BM25, default), "
                                      "usearch (approximate vectors, default) or flat (exact vectors)."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Build or update the retrieval index stored with a store."""
    from cachegraft_cli.api import index as index_store
    from cachegraft_cli.cli.output import showing_status

    with showing_status(json_out):  # a dense or hybrid index loads its embedder
        summary = index_store(store, kind, embedder, rebuild, engines=engine or None)
    if json_out:
        emit_json(summary)
    else:
        engines = ", ".join(summary["engines"].values())
        typer.echo(
            f"{summary['store']}: {summary['kind']} index ({engines}) {summary['mode']} over {summary['passages']} "
            f"passages ({summary['added']} indexed now) in {summary['seconds']:.1f} s."
        )
