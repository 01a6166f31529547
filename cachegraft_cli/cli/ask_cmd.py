from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated, Callable, Optional

import typer

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE
from cachegraft_cli.cli.options import (
    DeviceOpt,
    DtypeOpt,
    HiddenBlendLayerOpt,
    HiddenBlendOpt,
    JsonOpt,
    OrderOpt,
    RecomputeOpt,
    SchemeOpt,
    SharerOpt,
    StoreOpt,
    TopKOpt,
    TrustOpt,
    WeightsOpt,
)
from cachegraft_cli.cli.output import emit_json, log

if TYPE_CHECKING:
    from cachegraft_cli.answering.options import AskOptions


def ask(
    store: StoreOpt,
    question: Annotated[Optional[str], typer.Argument(help="The question (or use --questions).")] = None,
    k: TopKOpt = 3,
    system: Annotated[str, typer.Option(help="graft, adapter, mismatched, cache, text, closed or "
                                             "sharer-text.")] = "graft",
    scheme: SchemeOpt = "rotate",
    order: OrderOpt = DEFAULT_ORDER,
    recompute: RecomputeOpt = DEFAULT_RECOMPUTE,
    blend: HiddenBlendOpt = 0.0,
    blend_layer: HiddenBlendLayerOpt = 1,
    questions: Annotated[
        Optional[str],
        typer.Option("--questions", "-q", help="Batch mode: JSONL file of {id, question}, or - for stdin."),
    ] = None,
    index_kind: Annotated[Optional[str], typer.Option(help="Search a hybrid index as bm25 or dense.")] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", help="Batch mode: questions decoded together (1 to 4096).")
    ] = 8,
    max_new_tokens: Annotated[int, typer.Option(help="Answer length limit in tokens (at least 1).")] = 48,
    temperature: Annotated[float, typer.Option(help="0 = greedy; otherwise from 0.001 to 1000.")] = 0.0,
    seed: Annotated[Optional[int], typer.Option(help="Sampling seed.")] = None,
    show_passages: Annotated[bool, typer.Option(help="Print the retrieved sources after the answer.")] = False,
    sharer: SharerOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    trust_remote_code: TrustOpt = False,
    json_out: JsonOpt = False,
    server: Annotated[Optional[str], typer.Option(envvar="CACHEGRAFT_SERVER",
                                                  help="Ask a running `cachegraft serve` at this URL instead "
                                                       "(--store names its store).")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="CACHEGRAFT_API_KEY",
                                                   help="With --server: the server's API key.")] = None,
) -> None:
    """Answer a question from the store with the receiver only (or a baseline system)."""
    from cachegraft_cli.answering.options import check_batch_size, check_index_kind, with_settings
    from cachegraft_cli.answering.questions import read_questions
    from cachegraft_cli.errors import UsageError

    if (question is None) == (questions is None):
        raise UsageError("Give either a QUESTION or --questions FILE, not both or neither.",
                         'Example: cachegraft ask "Who founded the town?" --store my-store')
    # Everything that can be checked is checked before any model loads: options (by the same
    # checks as the API's), the questions file, then, by the API (`Store.check_ask`), the model
    # choices, the store, the questions, its index and whether each prompt fits the context window.
    options = with_settings(None, dict(system=system, k=k, scheme=scheme, order=order, recompute=recompute,
                                       blend=blend, blend_layer=blend_layer, max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed))
    check_batch_size(batch_size)
    check_index_kind(index_kind)
    items = read_questions(questions) if questions is not None else []
    if server:
        _refuse_model_options(sharer=sharer, device=device, dtype=dtype, weights=weights, index_kind=index_kind,
                              trust_remote_code=trust_remote_code or None)
        _ask_server(server, api_key, store, question, items, options, json_out, show_passages, batch_size)
        return
    # The local path's imports (the API and its model session) come after the server's early return:
    # `ask --server` is run once per question from shells and pays every import.
    from cachegraft_cli.api import Store
    from cachegraft_cli.cli.output import showing_status

    graft = Store(store, sharer=sharer, device=device, dtype=dtype, index_kind=index_kind,
                  trust_remote_code=trust_remote_code, weights=weights)
    graft.check_ask([q for _, q in items] if question is None else [question], options, note=log)
    batch = questions is not None
    with showing_status(json_out or batch):
        graft.warm(system)
    if batch:
        _batch(_local_batch(graft, options, batch_size), items, batch_size)
        return
    assert question is not None  # exactly one of QUESTION and --questions was given (checked above)
    stream = sys.stdout.isatty() and not json_out
    answer = graft.ask(question, options, on_text=_echo if stream else None)
    _print(answer.as_dict(), json_out, stream, show_passages)


def _refuse_model_options(**given) -> None:
    from cachegraft_cli.errors import UsageError

    named = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None]
    if named:
        raise UsageError(f"{', '.join(named)} choose the models of a server, not of a question sent to one.",
                         "Give them to `cachegraft serve`, or drop --server (and CACHEGRAFT_SERVER).")


def _ask_server(url: str, api_key: str | None, store: str, question: str | None, items: list[tuple],
                options: AskOptions, json_out: bool, show_passages: bool, batch_size: int) -> None:
    """The same output as answering here, from a running server (which decodes a batch's
    questions together: they are sent `batch_size` at a time)."""
    from cachegraft_cli.serving.client import Client

    client = Client(url, api_key)
    try:
        if question is not None:
            _print(client.ask(store, question, options), json_out, False, show_passages)
        else:
            _batch(lambda qs: client.ask_many(store, qs, options, concurrency=batch_size), items, batch_size)
    finally:
        client.close()


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


def _batch(answer: Callable[[list[str]], list[dict]], items: list[tuple], batch_size: int) -> None:
    """One JSON line out per question in, `answer` called on `batch_size` questions at a time
    (each result a dict, or {"question", "error"} for one that retrieved no passage; the exit
    code says so). On a TTY, stderr counts the questions answered."""
    from cachegraft_cli.errors import NoPassagesError

    failed = 0
    counter = _Counter(len(items))
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        for (qid, _), result in zip(chunk, answer([q for _, q in chunk])):
            failed += "error" in result
            emit_json({"id": qid, **result})
        counter.add(len(chunk))
    counter.done()
    if failed:
        raise NoPassagesError(f"{failed} of {len(items)} questions retrieved no passage (see their error lines).",
                              "Rephrase them with words from the corpus, or use a dense index.")


def _local_batch(graft, options: AskOptions, batch_size: int) -> Callable[[list[str]], list[dict]]:
    """Questions decoded together here; when one retrieves nothing, each is answered alone."""
    from cachegraft_cli.errors import NoPassagesError

    def answer(questions: list[str]) -> list[dict]:
        try:
            return [a.as_dict() for a in graft.ask_many(questions, options, batch_size=batch_size)]
        except NoPassagesError:
            return [_one(graft, q, options) for q in questions]

    return answer


def _one(graft, question: str, options: AskOptions) -> dict:
    from cachegraft_cli.errors import NoPassagesError

    try:
        return graft.ask(question, options).as_dict()
    except NoPassagesError as exc:
        return {"question": question, "error": exc.message}


class _Counter:
    """`answered N/M` on stderr, rewritten in place; only when stderr is a TTY (NDJSON runs stay quiet)."""

    def __init__(self, total: int):
        self.total, self.n, self.on = total, 0, sys.stderr.isatty()

    def add(self, n: int) -> None:
        self.n += n
        if self.on:
            sys.stderr.write(f"\ranswered {self.n}/{self.total}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.on and self.n:
            sys.stderr.write("\n")
            sys.stderr.flush()
