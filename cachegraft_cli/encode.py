"""Corpus -> fused-cache store.

Idempotent and resumable: a passage whose content hash is already in the store
is skipped, and rows become visible only when their segment commits (every
`commit_every` passages and at the end), so an interrupted run loses at most
one uncommitted window and a re-run finishes the job without duplicates.

Order (what makes two writers, a kill or a full disk harmless):
  1. the corpus is read and checked by the caller (`check_corpus`), the target
     store by `preflight`: nothing is written, no model is loaded;
  2. the store's writer lock is taken (a second writer is refused at once);
  3. the models load, the store is created or opened: the plan is made
     against the manifest as it is once the lock is held;
  4. the corpus is streamed again, window by window, each window one segment.
The corpus is never held in memory as a whole: it is read once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property

from cachegraft_cli.corpus import Passage
from cachegraft_cli.errors import CorpusError, UsageError
from cachegraft_cli.session import ModelSession

MAX_BATCH_SIZE = 4096  # passages per forward pass; more only pads memory to no gain


@dataclass
class EncodeOptions:
    codec: str = "bf16"
    batch_size: int = 8
    max_passage_tokens: int = 512
    also_own_cache: bool = False
    commit_every: int = 2000

    def __post_init__(self):
        from cachegraft_cli.store.codecs import CODECS

        if self.codec not in CODECS:  # checked here, before any model loads (tens of seconds)
            raise UsageError(f"unknown cache codec {self.codec!r}.", f"Use one of: {', '.join(CODECS)}.")
        _check_range("batch size", self.batch_size, 1, MAX_BATCH_SIZE)
        _check_range("max passage tokens", self.max_passage_tokens, 16, 1 << 20)
        _check_range("commit every", self.commit_every, 1, 1 << 30)

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("fused", "own") if self.also_own_cache else ("fused",)


def _check_range(what: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise UsageError(f"{what} must be a whole number from {low} to {high:,}; got {value!r}.",
                         f"Pass a value from {low} to {high:,}.")


@dataclass
class EncodeSummary:
    store: str
    passages_read: int = 0
    added: int = 0
    skipped_existing: int = 0
    skipped_bad: int = 0
    chunks_split: int = 0
    tokens: int = 0
    bytes: int = 0
    bytes_per_token: float = 0.0
    seconds: float = 0.0
    segments: list[str] = field(default_factory=list)
    skipped_reasons: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Chunk:
    """One unit of encoding: a passage, or a piece of a long one."""

    passage: Passage
    text: str
    ids: list[int]
    block: str
    index: int | None = None
    span: tuple[int, int] | None = None

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the exact block the cache is computed from."""
        from cachegraft_cli.store import content_hash_of

        return content_hash_of(self.block)

    @property
    def id(self) -> str:
        return self.passage.id if self.index is None else f"{self.passage.id}#{self.index}"


def split_passage(passage: Passage, template, max_tokens: int) -> list[Chunk]:
    """Token-aware split of a passage that does not fit `max_tokens` (never truncates).

    Cuts fall on token boundaries, preferring whitespace; each chunk carries
    the passage title and its character span in the original text.
    """
    text = passage.text.strip()
    ids = template.passage_ids(passage.title, text)
    if len(ids) <= max_tokens:
        return [Chunk(passage, text, ids, template.passage_block(passage.title, text))]
    budget = max(8, max_tokens - len(template.passage_ids(passage.title, "")))
    while True:  # re-tokenising a piece with its title can merge or split a few tokens: shrink until all fit
        chunks = _chunks(passage, text, template, budget)
        if all(len(c.ids) <= max_tokens for c in chunks) or budget <= 8:
            return chunks
        budget -= max(1, budget // 16)


def _chunks(passage: Passage, text: str, template, budget: int) -> list[Chunk]:
    chunks = []
    for index, (a, b) in enumerate(_spans(text, template.tokenizer, budget)):
        piece = text[a:b].strip()
        chunks.append(Chunk(passage, piece, template.passage_ids(passage.title, piece),
                            template.passage_block(passage.title, piece), index, (a, b)))
    return chunks


def _spans(text: str, tokenizer, budget: int) -> list[tuple[int, int]]:
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    spans, first = [], 0
    while first < len(offsets):
        last = min(first + budget, len(offsets)) - 1
        cut = _whitespace_cut(text, offsets, first, last)
        spans.append((offsets[first][0], offsets[cut][1]))
        first = cut + 1
    spans[-1] = (spans[-1][0], len(text))
    return spans


def _whitespace_cut(text: str, offsets, first: int, last: int) -> int:
    """Index of the last token of this chunk: prefer one that ends before a space."""
    if last == len(offsets) - 1:
        return last
    for i in range(last, first + (last - first) // 2, -1):
        end = offsets[i][1]
        if end < len(text) and text[end].isspace():
            return i
    return last


def check_corpus(reader) -> int:
    """Read the whole corpus once (streamed) and check every record; the passage count.
    An input that yields no passage at all is an error, not an empty store."""
    count = reader.validate()
    if count:
        return count
    skipped = sum(reader.skipped.values())
    if skipped:
        raise CorpusError(f"{reader.source}: every record was bad ({skipped} skipped: "
                          f"{', '.join(f'{n} {why}' for why, n in reader.skipped.items())}).",
                          "Fix the input; nothing was written.")
    if reader.format == "dir":
        raise CorpusError(f"{reader.source}: no readable .txt or .md file in this directory.",
                          "Point at a directory of .txt/.md files, or at a JSONL/CSV/JSON corpus.")
    raise CorpusError(f"{_label(reader.source)}: the corpus holds no passages.", "Give a corpus with at least one passage.")


def _label(source: str) -> str:
    return "<stdin>" if source == "-" else source


def encode_corpus(
    passages: Iterable[Passage],
    store_url: str,
    session: ModelSession,
    options: EncodeOptions,
    progress: Callable[[int, int], None] | None = None,
    total: int | None = None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode passages into the store at `store_url` (created if missing).

    `passages` is read more than once (plan, then write): a `CorpusReader` or a
    list; a one-shot iterator is listed first. `planned(n)` hears how many
    chunks will be encoded, once that is known.
    """
    from cachegraft_cli.storage import writing
    from cachegraft_cli.store.lock import lock_store
    from cachegraft_cli.store.preflight import check_target
    from cachegraft_cli.store.repair import recover

    start = time.perf_counter()
    source = list(passages) if iter(passages) is passages else passages
    check_target(store_url, options.codec, options.kinds)
    summary = EncodeSummary(store=store_url)
    with lock_store(store_url, {"tool": "cachegraft encode"}) as lock:
        store = session.open_or_create_store(store_url, options.codec, options.also_own_cache)
        recover(store)  # committed-but-unlisted segments count as stored before the plan is made
        todo = _plan(source, store, session.template, options, summary)
        if planned:
            planned(todo)
        with writing(store_url, "write the store"):
            _write(_todo(source, store, session.template, options), store, session, options, summary, progress, lock)
    summary.seconds = round(time.perf_counter() - start, 3)
    summary.bytes_per_token = round(summary.bytes / summary.tokens, 2) if summary.tokens else 0.0
    return summary


def _corpus_chunks(passages, template, options: EncodeOptions, summary: EncodeSummary | None = None):
    """Every chunk of every passage, in corpus order (counted into `summary` when given)."""
    for passage in passages:
        chunks = split_passage(passage, template, options.max_passage_tokens)
        if summary is not None:
            summary.passages_read += 1
            summary.chunks_split += len(chunks) - 1
        yield from chunks


def _plan(passages, store, template, options: EncodeOptions, summary: EncodeSummary) -> int:
    """Check every chunk against the store before writing anything; how many are new
    (same id, same content hash: stored already; identical text under two ids is stored twice)."""
    known = store.content_hashes()
    seen: set[str] = set()
    for chunk in _corpus_chunks(passages, template, options, summary):
        _check_changed(chunk, known, chunk.content_hash)
        if known.get(chunk.id) == chunk.content_hash or chunk.id in seen:  # stored already, or a repeat
            summary.skipped_existing += 1
            continue
        seen.add(chunk.id)
    return len(seen)


def _todo(passages, store, template, options: EncodeOptions):
    """The chunks `_plan` counted, streamed again (the plan checked them all)."""
    known = store.content_hashes()
    seen: set[str] = set()
    for chunk in _corpus_chunks(passages, template, options):
        if known.get(chunk.id) != chunk.content_hash and chunk.id not in seen:
            seen.add(chunk.id)
            yield chunk


def _check_changed(chunk: Chunk, known: dict, digest: str) -> None:
    if chunk.id in known and known[chunk.id] != digest:
        where = f"{chunk.passage.source}:{chunk.passage.line}" if chunk.passage.line else chunk.passage.source
        raise CorpusError(
            f"{where}: passage {chunk.id!r} is already in the store with different text.",
            "Stores are append-only: give the changed passage a new id, or encode into a new --store.",
        )


def reencode_rows(store_url: str, rows: list, session: ModelSession, options: EncodeOptions, lock) -> EncodeSummary:
    """Encode stored rows again (passages `store repair` dropped), from their stored text, chunk by
    chunk as they were split; the caller holds the store's lock. A row whose block the loaded
    template does not reproduce (its content hash differs) is skipped and counted as bad."""
    from cachegraft_cli.storage import writing

    store = session.open_or_create_store(store_url, options.codec, options.also_own_cache)
    summary = EncodeSummary(store=store_url)
    chunks = []
    for row in rows:
        chunk = _chunk_of_row(row, session.template)
        if chunk.content_hash != row.content_hash or row.id in store:
            summary.skipped_bad += 1
            summary.skipped_reasons[row.id] = "stored again already" if row.id in store else "template differs"
            continue
        chunks.append(chunk)
    summary.passages_read = len(rows)
    with writing(store_url, "write the store"):
        _write(iter(chunks), store, session, options, summary, None, lock)
    return summary


def _chunk_of_row(row, template) -> Chunk:
    meta = dict(row.metadata or {})
    span = tuple(meta.pop("char_span")) if "char_span" in meta else None
    passage = Passage(row.parent_id or row.id, row.title, row.text, meta)
    return Chunk(passage, row.text, template.passage_ids(row.title, row.text), template.passage_block(row.title, row.text),
                 row.chunk_index, span)  # type: ignore[arg-type]


def _write(chunks, store, session: ModelSession, options: EncodeOptions, summary, progress, lock) -> None:
    """Encode in commit windows; each window is one segment, visible once committed."""
    for window in _windows(chunks, options.commit_every):
        with store.writer({"tool": "cachegraft encode", "passages": len(window)}, lock=lock) as writer:
            for batch in _batches(window, options.batch_size):
                _encode_batch(batch, writer, session, options, summary)
                if progress:
                    progress(len(batch), sum(len(c.ids) for c in batch))
            entry = writer.commit()
        if entry:
            summary.segments.append(entry["name"])
            summary.bytes += sum(entry["bytes"].values())


def _windows(chunks, size: int):
    window: list[Chunk] = []
    for chunk in chunks:
        window.append(chunk)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def _batches(chunks: list[Chunk], size: int) -> list[list[Chunk]]:
    ordered = sorted(chunks, key=lambda c: len(c.ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _encode_batch(batch: list[Chunk], writer, session: ModelSession, options: EncodeOptions, summary) -> None:
    from cachegraft_cli import kvcache

    for chunk, kv in zip(batch, session.engine().fuse([c.ids for c in batch])):
        caches = {"fused": kvcache.to_token_major(kv.fused)}
        if "own" in writer.store.kinds:
            caches["own"] = kvcache.to_token_major(kv.own)
        writer.add(_row(chunk), caches)
        summary.added += 1
        summary.tokens += len(chunk.ids)


def _row(chunk: Chunk):
    from cachegraft_cli.store import PassageRow

    p = chunk.passage
    meta = dict(p.metadata)
    if chunk.span is not None:
        meta["char_span"] = list(chunk.span)
    return PassageRow(
        id=chunk.id,
        title=p.title,
        text=chunk.text,
        content_hash=chunk.content_hash,
        metadata=meta,
        parent_id=p.id if chunk.index is not None else None,
        chunk_index=chunk.index,
    )
