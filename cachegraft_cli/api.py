"""The Python API: the stable surface a program uses, and the one the CLI calls.

    import cachegraft_cli as cg

    cg.encode("corpus.jsonl", "my-store", models=cg.Models(preset="offline"))  # new, or an append
    cg.index("my-store")
    store = cg.open_store("my-store")        # models load on first use and stay loaded
    answer = store.ask("When was Harrowmere founded?", k=3)
    print(answer.text, [s.id for s in answer.sources])
    answers = store.ask_many(["Q1", "Q2"], batch_size=8)

The verbs are the CLI's: `encode`, `index`, `ask` (and `ask_many`, its batch form);
`cg.ask` / `cg.ask_many` are one-shot forms (open, answer, forget). Ask settings are
typed keyword arguments (`AskSettings`: `system`, `k`, `scheme`, `order`, `recompute`,
`blend`, `blend_layer` and the generation settings `max_new_tokens`, `temperature`,
`top_p`, `seed`, `draft_tokens`), or a whole `AskOptions` passed as `options=`. Errors are
`CacheGraftError`s (`message`, `hint`, `exit_code`). Nothing here prints: pass
`progress=` to `encode` for a progress callback. `encode` takes its settings as three
objects: `models=Models(...)`, `options=EncodeOptions(...)`, `source=CorpusSource(...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypedDict

from cachegraft_cli import checks
from cachegraft_cli.answering.options import AskOptions, check_batch_size, check_index_kind, with_settings
from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.plan import EncodeOptions, EncodeSummary
from cachegraft_cli.errors import CacheGraftError, UsageError
from cachegraft_cli.lm.sampling import GenerationOptions

if TYPE_CHECKING:
    from typing import Unpack

    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.encoding.ray.driver import RayOptions

# The one list of the package's public names (`cachegraft_cli.__init__` re-exports exactly these).
__all__ = ["Answer", "AskOptions", "AskSettings", "CacheGraftError", "CorpusSource", "EncodeOptions",
           "EncodeSummary", "GenerationOptions", "Models", "Passage", "RayOptions", "Source", "Store", "ask",
           "ask_many", "ask_options", "encode", "index", "open_store"]

Corpus = str | Path | Iterable[Passage | dict]


class AskSettings(TypedDict, total=False):
    """The keyword arguments of `Store.ask` and friends: `AskOptions`' fields, generation's flattened."""

    system: str
    k: int
    scheme: str
    order: str
    recompute: int
    blend: float
    blend_layer: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    draft_tokens: int


def __getattr__(name: str) -> Any:
    if name == "RayOptions":  # importable without Ray installed; kept lazy like every runner
        from cachegraft_cli.encoding.ray.driver import RayOptions

        return RayOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
@dataclass(frozen=True)
class Source:
    """A retrieved passage an answer was read from."""

    id: str
    title: str
    score: float


@dataclass(frozen=True)
class Answer:
    """One answer. `as_dict()` is the JSON the CLI prints (`ask --json`), with every field."""

    question: str
    text: str
    sources: tuple[Source, ...]
    system: str
    k: int
    timings: dict[str, float]
    tokens: dict[str, int]
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @classmethod
    def from_result(cls, result: dict) -> Answer:
        sources = tuple(Source(p["id"], p.get("title", ""), p.get("score", 0.0)) for p in result.get("passages", []))
        return cls(result["question"], result["answer"], sources, result["system"], result["k"],
                   dict(result.get("timings", {})), dict(result.get("tokens", {})), dict(result))

    def as_dict(self) -> dict[str, Any]:
        return dict(self.raw)

    def __str__(self) -> str:
        return self.text


def ask_options(options: AskOptions | None = None, **settings: Unpack[AskSettings]) -> AskOptions:
    """`options` (default `AskOptions()`) with `settings` applied, checked; an unknown name is refused."""
    return with_settings(options, dict(settings))


class Store:
    """A cache store to ask (and append to). Models load on first use and stay loaded
    across questions; `warm()` loads them now. `sharer` names the model of the
    `sharer-text` system when the store ran none; `device`/`dtype` override the defaults;
    `weights` "int8" or "int4" answers with the receiver's linears in weight-only int8 / int4
    (CPU only: a faster decode step that changes answers a little, see docs/results.md).

    Every ask is checked here, once, before any model loads (`check_ask`): the questions,
    the options against the store's metadata, the context window."""

    def __init__(self, path: str | Path, *, sharer: str | None = None, device: str | None = None,
                 dtype: str | None = None, index_kind: str | None = None, trust_remote_code: bool = False,
                 weights: str | None = None):
        from cachegraft_cli.session import ModelOverrides
        from cachegraft_cli.store import CacheStore

        self.path = checks.location("store", path)
        for name, value in (("sharer (--sharer)", sharer), ("device (--device)", device), ("dtype (--dtype)", dtype),
                            ("weights (--weights)", weights)):
            checks.optional_text(name, value)
        self._index_kind = check_index_kind(index_kind)
        checks.flag("trust_remote_code (--trust-remote-code)", trust_remote_code)
        CacheStore.check_exists(self.path)  # a missing store fails here, with its hint
        # device, dtype, weights and a local sharer are checked now, before anything loads
        self._overrides = ModelOverrides(sharer, device, dtype, trust_remote_code, weights).check()
        self._opened: Asker | None = None
        self._checked: tuple[AskOptions, set[str]] | None = None  # what `check_ask` passed last

    def _asker(self) -> Asker:
        """The `answering.ask.Asker` holding this store's snapshot, index and loaded models."""
        if self._opened is None:
            from cachegraft_cli.answering.ask import Asker

            self._opened = Asker(self.path, self._overrides, self._index_kind)
        return self._opened

    def info(self) -> dict:
        """What `cachegraft store info --json` prints."""
        from cachegraft_cli.retrieval.stored import store_report

        return store_report(self.path)

    def check(self, system: str = "graft") -> None:
        """Refuse a system the store cannot serve, reading only its metadata (no model loads)."""
        self._asker().check_system(system)

    def check_ask(self, questions: list[str], options: AskOptions | None = None, *,
                  note: Callable[[str], None] | None = None) -> None:
        """Refuse, before any model loads, what asking `questions` with `options` would refuse: a
        question that is no text, options the store cannot serve, a prompt past the model's context
        window. `note` hears what is worth saying first (a closed fuser, an index that misses
        passages). Asking these questions with these options afterwards checks nothing again."""
        checks.callback("note", note)
        items = checks.listed("questions", questions, example='["Who founded the town?"]')
        self._preflight(items, ask_options(options), note)

    def _preflight(self, questions: list, opts: AskOptions, note: Callable[[str], None] | None = None,
                   listed_as: str | None = None) -> None:
        """`check_ask` on checked options; nothing to do for questions already checked with them.
        `listed_as`: the questions are a list argument so named, a mistake is named by its index."""
        from cachegraft_cli.answering.systems import check_question

        done = self._checked
        if done is not None and done[0] == opts and all(isinstance(q, str) and q in done[1] for q in questions):
            return
        for i, q in enumerate(questions):
            if listed_as is None:
                check_question(q)
            else:
                checks.text(f"{listed_as}[{i}]", q)
        asker = self._asker()
        asker.check_options(opts)  # the system and a blend layer, from the store's metadata
        if note is not None:  # the notes read the index: only when someone listens
            for line in asker.notes(opts.system):
                note(line)
        asker.check_fits(questions, opts)  # the context window, from metadata: before the models load
        self._checked = (opts, set(questions))

    def warm(self, system: str = "graft") -> None:
        """Load the index and the models `system` needs now (later answers' timings exclude it)."""
        self.check(system)
        self._asker().warm(system)

    def ask(self, question: str, options: AskOptions | None = None, *,
            on_text: Callable[[str], None] | None = None, **settings: Unpack[AskSettings]) -> Answer:
        """Answer one question; `on_text` receives the answer's text as it is decoded."""
        opts = ask_options(options, **settings)
        checks.callback("on_text", on_text)
        self._preflight([question], opts)
        asker = self._asker()
        asker.warm(opts.system)
        return Answer.from_result(asker.ask(question, opts, on_text=on_text))

    def ask_many(self, questions: Iterable[str], options: AskOptions | None = None, *, batch_size: int = 8,
                 **settings: Unpack[AskSettings]) -> list[Answer]:
        """Answer questions decoded together in batches of `batch_size`, in order (an empty list:
        no answers, nothing loaded). A question that retrieves no passage raises `NoPassagesError`."""
        opts = ask_options(options, **settings)
        check_batch_size(batch_size)
        items = checks.listed("questions", questions, example='["Who founded the town?", "When?"]')
        if not items:
            return []  # nothing to answer: no model needs loading
        self._preflight(items, opts, listed_as="questions")
        asker = self._asker()
        asker.warm(opts.system)
        return [Answer.from_result(r) for r in asker.ask_many(items, opts, batch_size)]

    def encode(self, corpus: Corpus, *, options: EncodeOptions | None = None, source: CorpusSource | None = None,
               progress: Callable[[int, int], None] | None = None) -> EncodeSummary:
        """Append passages with the store's own models (see `encode`); the store is reopened after."""
        summary = encode(corpus, self.path, options=options, source=source, progress=progress)
        self._refresh()
        return summary

    def index(self, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
              engines: list[str] | None = None) -> dict:
        """Build or update the store's retrieval index (see `index`)."""
        summary = index(self.path, kind, embedder, rebuild, engines)
        self._refresh()
        return summary

    def _refresh(self) -> None:
        """A new snapshot of the store and its index, keeping the loaded models."""
        if self._opened is not None:
            from cachegraft_cli.answering.ask import Asker

            self._opened = Asker(self.path, self._overrides, self._index_kind, session=self._opened.session)
            self._checked = None  # another snapshot: its checks are its own

    def __repr__(self) -> str:
        return f"Store({self.path!r})"


def open_store(path: str | Path, *, sharer: str | None = None, device: str | None = None, dtype: str | None = None,
               index_kind: str | None = None, trust_remote_code: bool = False, weights: str | None = None) -> Store:
    """Open a store to ask; see `Store` for the options."""
    return Store(path, sharer=sharer, device=device, dtype=dtype, index_kind=index_kind,
                 trust_remote_code=trust_remote_code, weights=weights)


@dataclass(frozen=True)
class Models:
    """Which models `encode` makes a new store with: a `preset` (the paper's pair when nothing is
    given) and overrides, loaded on `device` in `dtype`. An append takes the store's own models;
    models named for one must be the store's. Checked when made, as `cachegraft encode` checks them."""

    preset: str | None = None
    receiver: str | None = None
    sharer: str | None = None
    fuser: str | None = None
    device: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    instruction: str | None = None

    def __post_init__(self) -> None:
        for name in ("preset", "receiver", "sharer", "fuser", "device", "dtype", "instruction"):
            checks.optional_text(f"{name} (--{name})", getattr(self, name))
        checks.flag("trust_remote_code (--trust-remote-code)", self.trust_remote_code)


@dataclass(frozen=True)
class CorpusSource:
    """How `encode` reads a corpus file: `format` (jsonl, csv, tsv, json, dir; default by
    extension), the fields holding id, text and title, and `skip_bad` (skip and count bad records
    instead of stopping). Checked when made, as `cachegraft encode` checks them."""

    format: str | None = None
    id_field: str = "id"
    text_field: str = "text"
    title_field: str = "title"
    skip_bad: bool = False

    def __post_init__(self) -> None:
        checks.optional_text("format (--format)", self.format)
        for name in ("id_field", "text_field", "title_field"):
            checks.text(f"{name} (--{name.replace('_', '-')})", getattr(self, name))
        checks.flag("skip_bad (--skip-bad)", self.skip_bad)


def encode(
    corpus: Corpus,
    store: str | Path,
    *,
    models: Models | None = None,
    options: EncodeOptions | None = None,
    source: CorpusSource | None = None,
    runner: str | RayOptions = "local",
    progress: Callable[[int, int], None] | None = None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode a corpus into a store: a new one with `models` (the paper's pair when none are
    given), an existing one with the models recorded in it.

    `corpus` is a path (JSONL, CSV/TSV, SQuAD JSON, a directory of .txt/.md, `-` for stdin; read
    as `source` says) or an iterable of `Passage`s or dicts with `id`, `text` and optional `title`
    (other keys become metadata). The encode settings are `options` (`EncodeOptions`: codec,
    batch size, keep, compressor, ...; see `cachegraft encode`). `runner` is `"local"` (this
    process), `"ray"` or a `RayOptions` (actors on a Ray cluster). Re-encoding what is stored is
    skipped without loading any model; `planned(n)` hears how many chunks will be encoded,
    `progress(passages, tokens)` each batch."""
    from cachegraft_cli.corpus import from_records, read_corpus
    from cachegraft_cli.encoding.plan import check_corpus
    from cachegraft_cli.encoding.run import encode_into

    store = checks.location("store", store)  # None would become a directory named ./None
    _check_encode_arguments(corpus, models, options, source, callbacks={"progress": progress, "planned": planned})
    models, source = models or Models(), source or CorpusSource()
    ray_options = _runner(runner, models.device)  # checked before the corpus is read
    fields_: dict[str, Any] = {"id_field": source.id_field, "text_field": source.text_field,
                               "title_field": source.title_field}
    if isinstance(corpus, (str, Path)):
        reader = read_corpus(corpus, skip_bad=source.skip_bad, format=source.format, **fields_)
    else:
        reader = from_records(corpus, skip_bad=source.skip_bad, **fields_)
    check_corpus(reader)  # every record checked (a file is streamed, never held whole) before anything else
    summary = encode_into(str(store), reader, options or EncodeOptions(), preset=models.preset,
                          receiver=models.receiver, sharer=models.sharer, fuser=models.fuser, device=models.device,
                          dtype=models.dtype, trust_remote_code=models.trust_remote_code,
                          instruction=models.instruction, progress=progress, ray=ray_options, planned=planned)
    summary.skipped_bad = sum(reader.skipped.values())
    summary.skipped_reasons = dict(reader.skipped)
    return summary


def _check_corpus_argument(corpus: Any) -> None:
    """A path (str or os.PathLike, `-` for stdin) or an iterable of records; each record is
    checked as it is read (`corpus.from_records`). A mapping would be read as its keys."""
    import os

    if isinstance(corpus, (str, os.PathLike)):
        checks.location("corpus", corpus)
    elif isinstance(corpus, (bytes, dict)) or not isinstance(corpus, Iterable):
        raise UsageError(f"corpus must be a path or a list of passages; got {type(corpus).__name__}.",
                         "Pass a corpus file or directory, or a list of cg.Passage or dicts with id and text, "
                         "e.g. [{'id': 'a', 'text': 'Harbor town was founded in 1820.'}].")


def _check_encode_arguments(corpus: Any, models: Any, options: Any, source: Any, *, callbacks: dict) -> None:
    """`encode`'s arguments, before anything is read: the corpus, the callbacks and the three
    settings objects (each checked its fields when it was made)."""
    _check_corpus_argument(corpus)
    for name, value in callbacks.items():
        checks.callback(name, value)
    checks.instance("models", models, Models, "Build one with cg.Models(receiver=..., ...).")
    checks.instance("options", options, EncodeOptions, "Build one with cg.EncodeOptions(codec=..., batch_size=...).")
    checks.instance("source", source, CorpusSource, "Build one with cg.CorpusSource(format=..., skip_bad=...).")


def _runner(runner: Any, device: str | None) -> RayOptions | None:
    """None for the local runner; Ray's options (`"ray"`: the defaults), checked, with ray importable."""
    from cachegraft_cli.encoding import RUNNERS

    if isinstance(runner, str) and runner == "local":
        return None  # the Ray driver is not even imported
    from cachegraft_cli.encoding.ray.driver import RayOptions, check_devices, require_ray

    if isinstance(runner, str) and runner in RUNNERS:
        runner = RayOptions()
    if not isinstance(runner, RayOptions):
        raise UsageError(f"unknown runner {runner!r}.", f"Use one of: {', '.join(RUNNERS)}, or a cg.RayOptions.")
    check_devices(device, runner)
    require_ray()
    return runner


def index(store: str | Path, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
          engines: list[str] | None = None) -> dict:
    """Build the store's retrieval index, or add the passages encoded since (`kind`: bm25,
    dense or hybrid; `embedder`: a sentence-transformers model for dense/hybrid; `engines`:
    tantivy, usearch or flat for its parts, default the existing index's or tantivy + usearch)."""
    from cachegraft_cli.retrieval.stored import build_store_index

    where = checks.location("store", store)
    checks.optional_text("embedder (--embedder)", embedder)
    checks.flag("rebuild (--rebuild)", rebuild)
    if engines is not None:
        engines = checks.texts("engines (--engine)", engines, example='["tantivy"]')
    return build_store_index(where, kind, embedder, rebuild, engines=engines)


def ask(question: str, store: str | Path, options: AskOptions | None = None, *, sharer: str | None = None,
        device: str | None = None, dtype: str | None = None, index_kind: str | None = None,
        trust_remote_code: bool = False, weights: str | None = None, **settings: Unpack[AskSettings]) -> Answer:
    """Answer one question from a store (models loaded for this call only; keep a `Store` to reuse them)."""
    ask_options(options, **settings)  # the options first, as the CLI does; the question in `Store.ask`
    opened = open_store(store, sharer=sharer, device=device, dtype=dtype, index_kind=index_kind,
                        trust_remote_code=trust_remote_code, weights=weights)
    return opened.ask(question, options, **settings)


def ask_many(questions: Iterable[str], store: str | Path, options: AskOptions | None = None, *,
             batch_size: int = 8, sharer: str | None = None, device: str | None = None, dtype: str | None = None,
             index_kind: str | None = None, trust_remote_code: bool = False, weights: str | None = None,
             **settings: Unpack[AskSettings]) -> list[Answer]:
    """Answer many questions from a store, decoded in batches."""
    ask_options(options, **settings)
    check_batch_size(batch_size)
    # the list now, its items by the Store (once)
    questions = checks.listed("questions", questions, example='["Who founded the town?", "When?"]')
    opened = open_store(store, sharer=sharer, device=device, dtype=dtype, index_kind=index_kind,
                        trust_remote_code=trust_remote_code, weights=weights)
    return opened.ask_many(questions, options, batch_size=batch_size, **settings)
