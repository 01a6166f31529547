"""The Python API: the stable surface a program uses, and the one the CLI calls.

    import cachegraft_cli as cg

    cg.encode_passages("corpus.jsonl", "my-store", preset="offline")   # a new store, or an append
    cg.index_store("my-store")
    store = cg.open_store("my-store")        # models load on first use and stay loaded
    answer = store.ask("When was Harrowmere founded?", k=3)
    print(answer.text, [s.id for s in answer.sources])
    answers = store.ask_many(["Q1", "Q2"], batch_size=8)

`cg.answer` / `cg.answer_many` are one-shot forms (open, answer, forget). (The names differ
from the `ask` / `encode` submodules, which a package attribute must not shadow.) Ask options are
keyword arguments: `system`, `k`, `scheme`, any other field of `ask.AskOptions`, and
the generation settings `max_new_tokens`, `temperature`, `top_p`, `seed`. Errors are
the typed `cachegraft_cli.errors.CacheGraftError`s (`message`, `hint`, `exit_code`).
Nothing here prints: pass `progress=` to `encode_passages` for a progress callback.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.plan import EncodeOptions, EncodeSummary
from cachegraft_cli.errors import UsageError

if TYPE_CHECKING:
    from cachegraft_cli.answering.ask import Asker, AskOptions

__all__ = ["Answer", "EncodeSummary", "Passage", "Source", "Store", "answer", "answer_many", "ask_options",
           "encode_passages", "index_store", "open_store"]

Corpus = str | Path | Iterable[Passage | dict]


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


def ask_options(**options: Any) -> AskOptions:
    """`AskOptions` from keyword arguments: its own fields plus `GenerationConfig`'s; an unknown
    name is refused. New `AskOptions` fields work here without a change to this function."""
    from cachegraft_cli.answering.ask import AskOptions
    from cachegraft_cli.lm.generation import GenerationConfig

    generation_names = {f.name for f in fields(GenerationConfig)}
    ask_names = {f.name for f in fields(AskOptions)} - {"generation"}
    unknown = sorted(set(options) - generation_names - ask_names)
    if unknown:
        raise UsageError(f"Unknown ask option(s): {', '.join(unknown)}.",
                         f"Known: {', '.join(sorted(ask_names | generation_names))}.")
    generation = GenerationConfig(**{k: v for k, v in options.items() if k in generation_names})
    built = AskOptions(**{k: v for k, v in options.items() if k in ask_names}, generation=generation)
    built.check()
    return built


class Store:
    """A cache store to ask (and append to). Models load on first use and stay loaded
    across questions; `warm()` loads them now. `sharer` names the model of the
    `sharer-text` system when the store ran none; `device`/`dtype` override the defaults."""

    def __init__(self, path: str | Path, *, sharer: str | None = None, device: str | None = None,
                 dtype: str | None = None, index_kind: str | None = None, trust_remote_code: bool = False):
        from cachegraft_cli.session import ModelChoice
        from cachegraft_cli.store import CacheStore

        self.path = str(path)
        CacheStore.check_exists(self.path)  # a missing store fails here, with its hint
        # device, dtype and a local sharer are checked now, before anything loads
        self._overrides = ModelChoice("", sharer, None, device=device, dtype=dtype,
                                      trust_remote_code=trust_remote_code).check()
        self._index_kind = index_kind
        self._asker: Asker | None = None

    @property
    def asker(self) -> Asker:
        """The `ask.Asker` holding this store's snapshot, index and loaded models."""
        if self._asker is None:
            from cachegraft_cli.answering.ask import Asker

            self._asker = Asker(self.path, self._overrides, self._index_kind)
        return self._asker

    def info(self) -> dict:
        """What `cachegraft store info --json` prints."""
        from cachegraft_cli.retrieval.stored import store_report

        return store_report(self.path)

    def check(self, system: str = "graft") -> None:
        """Refuse a system the store cannot serve, reading only its metadata (no model loads)."""
        self.asker.check_system(system)

    def warm(self, system: str = "graft") -> None:
        """Load the index and the models `system` needs now (later answers' timings exclude it)."""
        self.check(system)
        self.asker.warm(system)

    def ask(self, question: str, *, on_text: Callable[[str], None] | None = None, **options: Any) -> Answer:
        """Answer one question; `on_text` receives the answer's text as it is decoded."""
        from cachegraft_cli.answering.systems import check_question

        opts = ask_options(**options)
        check_question(question)
        self.warm(opts.system)
        return Answer.from_result(self.asker.ask(question, opts, on_text=on_text))

    def ask_many(self, questions: Iterable[str], *, batch_size: int = 8, **options: Any) -> list[Answer]:
        """Answer questions decoded together in batches of `batch_size`, in order. A question that
        retrieves no passage raises `NoPassagesError`."""
        from cachegraft_cli.answering.systems import check_question

        items = list(questions)
        opts = ask_options(**options)
        for q in items:
            check_question(q)
        if batch_size < 1:
            raise UsageError(f"batch_size must be at least 1, got {batch_size}.", "Use e.g. batch_size=8.")
        self.warm(opts.system)
        return [Answer.from_result(r) for r in self.asker.ask_many(items, opts, batch_size)]

    def encode(self, corpus: Corpus, *, progress: Callable[[int, int], None] | None = None,
               **options: Any) -> EncodeSummary:
        """Append passages with the store's own models (see `encode_passages`); the store is reopened after."""
        summary = encode_passages(corpus, self.path, progress=progress, **options)
        self._refresh()
        return summary

    def index(self, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
              engines: list[str] | None = None) -> dict:
        """Build or update the store's retrieval index (see `index_store`)."""
        summary = index_store(self.path, kind, embedder, rebuild, engines)
        self._refresh()
        return summary

    def _refresh(self) -> None:
        """A new snapshot of the store and its index, keeping the loaded models."""
        if self._asker is not None:
            from cachegraft_cli.answering.ask import Asker

            self._asker = Asker(self.path, self._overrides, self._index_kind, session=self._asker.session)

    def __repr__(self) -> str:
        return f"Store({self.path!r})"


def open_store(path: str | Path, **options: Any) -> Store:
    """Open a store to ask; see `Store` for the options."""
    return Store(path, **options)


def encode_passages(
    corpus: Corpus,
    store: str | Path,
    *,
    preset: str | None = None,
    receiver: str | None = None,
    sharer: str | None = None,
    fuser: str | None = None,
    codec: str | None = None,
    batch_size: int = 8,
    max_passage_tokens: int = 512,
    also_own_cache: bool = False,
    commit_every: int = 2000,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    instruction: str | None = None,
    skip_bad: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> EncodeSummary:
    """Encode a corpus into a store: a new one with the preset (the paper's pair when nothing is
    given) and overrides, an existing one with the models recorded in it.

    `corpus` is a path (JSONL, CSV/TSV, SQuAD JSON, a directory of .txt/.md) or an iterable
    of `Passage`s or dicts with `id`, `text` and optional `title` (other keys become metadata).
    Re-encoding what is stored is skipped without loading any model."""
    from cachegraft_cli.corpus import from_records, read_corpus
    from cachegraft_cli.encoding.plan import check_corpus
    from cachegraft_cli.encoding.run import encode_into

    options = EncodeOptions(codec, batch_size, max_passage_tokens, also_own_cache, commit_every)
    if isinstance(corpus, (str, Path)):
        reader = read_corpus(corpus, skip_bad=skip_bad)
    else:
        reader = from_records(corpus, skip_bad=skip_bad)
    check_corpus(reader)  # every record checked (a file is streamed, never held whole) before anything else
    summary = encode_into(str(store), reader, options, preset=preset, receiver=receiver, sharer=sharer,
                          fuser=fuser, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                          instruction=instruction, progress=progress)
    summary.skipped_bad = sum(reader.skipped.values())
    summary.skipped_reasons = dict(reader.skipped)
    return summary


def index_store(store: str | Path, kind: str = "bm25", embedder: str | None = None, rebuild: bool = False,
                engines: list[str] | None = None) -> dict:
    """Build the store's retrieval index, or add the passages encoded since (`kind`: bm25,
    dense or hybrid; `embedder`: a sentence-transformers model for dense/hybrid; `engines`:
    tantivy, usearch or flat for its parts, default the existing index's or tantivy + usearch)."""
    from cachegraft_cli.retrieval.stored import build_store_index

    return build_store_index(str(store), kind, embedder, rebuild, engines=engines)


def answer(question: str, store: str | Path, **options: Any) -> Answer:
    """Answer one question from a store (models loaded for this call only; keep a `Store` to reuse them)."""
    store_options = _store_options(options)
    return Store(store, **store_options).ask(question, **options)


def answer_many(questions: Iterable[str], store: str | Path, *, batch_size: int = 8, **options: Any) -> list[Answer]:
    """Answer many questions from a store, decoded in batches."""
    store_options = _store_options(options)
    return Store(store, **store_options).ask_many(questions, batch_size=batch_size, **options)


_STORE_OPTIONS = ("sharer", "device", "dtype", "index_kind", "trust_remote_code")


def _store_options(options: dict) -> dict:
    """Pop `Store`'s own options out of a one-shot call's keyword arguments."""
    return {k: options.pop(k) for k in _STORE_OPTIONS if k in options}
