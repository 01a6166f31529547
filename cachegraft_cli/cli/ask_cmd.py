from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from cachegraft_cli.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE
from cachegraft_cli.cli.options import (
    BlendLayerOpt, BlendOpt, DeviceOpt, DtypeOpt, JsonOpt, OrderOpt, RecomputeOpt, SchemeOpt, SharerOpt, StoreOpt, TopKOpt,
    TrustOpt,
)
from cachegraft_cli.cli.output import emit_json, log


def ask(
    question: Annotated[Optional[str], typer.Argument(help="The question (or use --questions).")] = None,
    store: StoreOpt = ...,
    k: TopKOpt = 3,
    system: Annotated[str, typer.Option(help="graft, adapter, cache, text, closed or sharer-text.")] = "graft",
    scheme: SchemeOpt = "rotate",
    order: OrderOpt = DEFAULT_ORDER,
    recompute: RecomputeOpt = DEFAULT_RECOMPUTE,
    blend: BlendOpt = 0.0,
    blend_layer: BlendLayerOpt = 1,
    questions: Annotated[
        Optional[str], typer.Option("--questions", "-q", help="Batch mode: JSONL file of {id, question}, or - for stdin.")
    ] = None,
    index_kind: Annotated[Optional[str], typer.Option(help="Search a hybrid index as bm25 or dense.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", "-b", min=1, help="Batch mode: questions decoded together.")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Answer length limit in tokens.")] = 48,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    show_passages: Annotated[bool, typer.Option(help="Print the retrieved sources after the answer.")] = False,
    sharer: SharerOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
) -> None:
    """Answer a question from the store with the receiver only (or a baseline system)."""
    from cachegraft_cli.ask import AskOptions, Asker
    from cachegraft_cli.errors import UsageError
    from cachegraft_cli.generation import GenerationConfig
    from cachegraft_cli.session import ModelChoice

    if (question is None) == (questions is None):
        raise UsageError("Give either a QUESTION or --questions FILE, not both or neither.",
                         'Example: cachegraft ask "Who founded the town?" --store my-store')
    overrides = ModelChoice("", sharer, None, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    options = AskOptions(system, k, scheme, GenerationConfig(max_new_tokens, temperature, 1.0, seed), order=order,
                         recompute=recompute, blend=blend, blend_layer=blend_layer)
    options.check()  # before the store opens and any model loads
    asker = Asker(store, overrides, index_kind)
    asker.check_system(system)
    _note_closed_fuser(asker, system)
    asker.warm(system)
    if questions is not None:
        _batch(asker, questions, options, batch_size)
        return
    stream = sys.stdout.isatty() and not json_out
    result = asker.ask(question, options, on_text=_echo if stream else None)
    _print(result, json_out, stream, show_passages)


def _note_closed_fuser(asker, system: str) -> None:
    if system == "graft" and asker.store.identity.get("fuser") is None:
        log("note: this store was encoded with the fuser closed, "
            "so `graft` answers from the receiver's own caches (the `cache` system).")


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _print(result: dict, json_out: bool, streamed: bool, show_passages: bool) -> None:
    if json_out:
        emit_json(result)
        return
    typer.echo("" if streamed else result["answer"])
    if show_passages:
        for i, p in enumerate(result["passages"], 1):
            typer.echo(f"  [{i}] {p['id']}  {p['title']}  (score {p['score']})")


def _batch(asker, source: str, options, batch_size: int) -> None:
    """One JSON line out per question in, models loaded once, decoded in batches.
    A question with no retrieved passage gets an error line; the exit code says so."""
    from cachegraft_cli.errors import NoPassagesError

    items = _read_questions(source)
    failed = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        try:
            results = asker.ask_many([q for _, q in chunk], options, batch_size)
        except NoPassagesError:
            results = [_one(asker, q, options) for _, q in chunk]
        for (qid, _), result in zip(chunk, results):
            failed += "error" in result
            emit_json({"id": qid, **result})
    if failed:
        raise NoPassagesError(f"{failed} of {len(items)} questions retrieved no passage (see their error lines).",
                              "Rephrase them with words from the corpus, or use a dense index.")


def _one(asker, question: str, options) -> dict:
    from cachegraft_cli.errors import NoPassagesError

    try:
        return asker.ask(question, options)
    except NoPassagesError as exc:
        return {"question": question, "error": exc.message}


def _read_questions(source: str) -> list[tuple]:
    from cachegraft_cli.errors import UsageError

    stream = sys.stdin if source == "-" else _open(source)
    items = []
    for n, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            items.append((item.get("id", n), item["question"]))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{source}:{n}: expected a JSON object with a \"question\" field.",
                             'Each line must look like {"id": "q1", "question": "..."}.') from None
    return items


def _open(path: str):
    from cachegraft_cli.errors import UsageError

    try:
        return open(path, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"Cannot read questions file {path}: {exc.strerror}.", "Check the path.") from None
