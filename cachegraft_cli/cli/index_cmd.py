from __future__ import annotations

from typing import Annotated, Optional

import typer

from cachegraft_cli.cli.options import JsonOpt, StoreOpt
from cachegraft_cli.cli.output import emit_json


def index(
    store: StoreOpt,
    kind: Annotated[str, typer.Option(help="bm25 (default, no model), dense, or hybrid.")] = "bm25",
    embedder: Annotated[
        Optional[str], typer.Option(help="Sentence-transformers model for dense/hybrid: hub id or local directory.")
    ] = None,
    rebuild: Annotated[bool, typer.Option(help="Rebuild from scratch instead of adding new passages.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Build or update the retrieval index stored with a store."""
    from cachegraft_cli.api import index_store
    from cachegraft_cli.cli.output import showing_status

    with showing_status(json_out):  # a dense or hybrid index loads its embedder
        summary = index_store(store, kind, embedder, rebuild)
    if json_out:
        emit_json(summary)
    else:
        typer.echo(
            f"{summary['store']}: {summary['kind']} index {summary['mode']} over {summary['passages']} passages "
            f"({summary['added']} indexed now) in {summary['seconds']:.1f} s."
        )
