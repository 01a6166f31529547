"""What encode does, in the vocabulary every runner shares: options, the summary, chunks
(passages split to the token budget), the plan against a store's content hashes, commit
windows, and the fusing of one window into a segment writer.

The runners (`encoding.local` in this process, `encoding.ray` on a cluster) differ only in
where windows are fused and who commits them; `encoding.run` picks one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import cached_property

from cachegraft_cli.checks import flag, one_of, whole
from cachegraft_cli.corpus import Passage
from cachegraft_cli.errors import CorpusError, UsageError
from cachegraft_cli.session import ModelSession

MAX_BATCH_SIZE = 4096  # passages per forward pass; more only pads memory to no gain
PASSAGE_TOKENS = 512  # encode's default chunk size (--max-passage-tokens)
MIN_PASSAGE_TOKENS = 16  # the smallest chunk size any command takes


@dataclass
class EncodeOptions:
    codec: str | None = None  # None: the existing store's; a new one's `encoding.calibration.default_codec`
    batch_size: int = 8
    max_passage_tokens: int = PASSAGE_TOKENS
    chunk_overlap: int = 0  # tokens a chunk of a split passage repeats from the end of the one before
    also_own_cache: bool = False
    commit_every: int = 2000
    keep: float | None = None  # share of each passage's tokens stored; None: the store's, 1 (all) for a new store
    keep_by: str | None = None  # how they are chosen (`encoding.keep`); None: the store's, else the default
    compressor: str | None = None  # `store.layout.COMPRESSORS`; None: the store's, zstd for a new store
    mismatched_sharer: bool | None = None  # the sharer reads a donor passage (`encoding.donors`); None: the store's
    sharer_notes: int | None = None  # tokens of sharer notes per passage (`encoding.notes`); None: the store's, 0: none
    calibration: str | None = None  # a new tc store's calibration file (`encoding.calibration`); None: the fuser's

    def __post_init__(self):
        from cachegraft_cli.encoding.keep import KEEP_METHODS
        from cachegraft_cli.store.codecs import CODECS
        from cachegraft_cli.store.layout import COMPRESSORS

        # checked here, before any model loads (tens of seconds); the CLI's options come through here too
        if self.codec is not None:
            one_of("cache codec", self.codec, CODECS)
        whole("batch_size (--batch-size)", self.batch_size, 1, MAX_BATCH_SIZE)
        whole("max_passage_tokens (--max-passage-tokens)", self.max_passage_tokens, MIN_PASSAGE_TOKENS, 1 << 20)
        # at most half a chunk: each chunk must move on by more than it repeats
        whole("chunk_overlap (--chunk-overlap)", self.chunk_overlap, 0, self.max_passage_tokens // 2)
        flag("also_own_cache (--also-own-cache)", self.also_own_cache)
        whole("commit_every (--commit-every)", self.commit_every, 1, 1 << 30)
        if self.keep is not None and (isinstance(self.keep, bool) or not isinstance(self.keep, (int, float))
                                      or not 0 < self.keep <= 1):
            raise UsageError(f"keep must be a share of tokens above 0 and at most 1; got {self.keep!r}.",
                             "Pass e.g. --keep 0.5 (half of each passage's tokens), or 1 to store every token.")
        if self.compressor is not None:
            one_of("compressor", self.compressor, tuple(COMPRESSORS))
        if self.mismatched_sharer is not None:
            flag("mismatched_sharer (--mismatched-sharer)", self.mismatched_sharer)
        if self.sharer_notes is not None:
            whole("sharer_notes (--sharer-notes)", self.sharer_notes, 0, 1024)
        if self.calibration is not None and not (isinstance(self.calibration, str) and self.calibration):
            raise UsageError(f"calibration must be a file path; got {self.calibration!r}.",
                             "Pass --calibration FILE (from `cachegraft store calibrate`).")
        if self.keep_by is not None and self.keep_by not in KEEP_METHODS:
            raise UsageError(f"unknown keep method {self.keep_by!r}.", f"Use one of: {', '.join(KEEP_METHODS)}.")

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("fused", "own") if self.also_own_cache else ("fused",)

    def keep_for(self, stored: dict | None) -> dict | None:
        """The store identity's `keep` this encode writes (None: every token): these options',
        else the existing store's (`stored`: None for an unpruned or a new store)."""
        from cachegraft_cli.encoding.keep import DEFAULT_KEEP_BY
        from cachegraft_cli.store.identity import keep_entry

        if self.keep is None and self.keep_by is None:
            return stored
        ratio = self.keep if self.keep is not None else (stored or {}).get("ratio", 1.0)
        return keep_entry(ratio, self.keep_by or (stored or {}).get("by") or DEFAULT_KEEP_BY)

    def with_keep(self, keep: dict | None) -> EncodeOptions:
        """These options set to a resolved `keep` (what the runners fuse with)."""
        from dataclasses import replace

        return replace(self, keep=1.0, keep_by=None) if keep is None else replace(self, keep=keep["ratio"],
                                                                                    keep_by=keep["by"])


@dataclass
class EncodeSummary:
    store: str
    passages_read: int = 0
    added: int = 0
    skipped_existing: int = 0
    skipped_bad: int = 0
    chunks_split: int = 0
    tokens: int = 0
    stored_tokens: int = 0  # fewer than `tokens` in a pruned store (`--keep`)
    bytes: int = 0
    bytes_per_token: float = 0.0
    seconds: float = 0.0
    segments: list[str] = field(default_factory=list)
    skipped_reasons: dict = field(default_factory=dict)
    fuser: str | None = None  # the fuser spec the store's caches come from ("closed": none)
    codec: str | None = None  # the store's codec
    note: str | None = None  # something the user should know (e.g. why a new store got the codec it has)

    def as_dict(self) -> dict:
        return asdict(self)

    def finish(self) -> None:
        self.bytes_per_token = round(self.bytes / self.tokens, 2) if self.tokens else 0.0


@dataclass
class Chunk:
    """One unit of encoding: a passage, or a piece of a long one."""

    passage: Passage
    text: str
    ids: list[int]
    block: str
    index: int | None = None
    span: tuple[int, int] | None = None
    donor: tuple[str, list[int]] | None = None  # mismatched-sharer control: (donor id, the ids the sharer reads)
    notes: str | None = None  # the sharer's notes (`encoding.notes`); `ids` then cover the text and the notes

    @cached_property
    def content_hash(self) -> str:
        """sha256 of the exact block the cache is computed from."""
        from cachegraft_cli.store import content_hash_of

        return content_hash_of(self.block)

    @property
    def id(self) -> str:
        return self.passage.id if self.index is None else f"{self.passage.id}#{self.index}"

    def row(self):
        """The store row this chunk is written as (a piece of a long passage names its parent and span)."""
        from cachegraft_cli.store import PassageRow

        p = self.passage
        meta = dict(p.metadata)
        if self.span is not None:
            meta["char_span"] = list(self.span)
        if self.donor is not None:
            meta["sharer_donor"] = self.donor[0]
        if self.notes is not None:
            from cachegraft_cli.store.rows import NOTES_KEY

            meta[NOTES_KEY] = self.notes
        return PassageRow(
            id=self.id,
            title=p.title,
            text=self.text,
            content_hash=self.content_hash,
            metadata=meta,
            parent_id=p.id if self.index is not None else None,
            chunk_index=self.index,
        )

    def to_record(self) -> dict:
        """A plain-JSON form, to hand a planned chunk to another process (a Ray actor).

        The passage's full text is not carried: a chunk's row needs only its own piece."""
        p = self.passage
        return {"id": p.id, "title": p.title, "metadata": p.metadata, "source": p.source, "line": p.line,
                "text": self.text, "ids": self.ids, "block": self.block, "index": self.index,
                "span": list(self.span) if self.span is not None else None}

    @classmethod
    def from_record(cls, record: dict) -> Chunk:
        passage = Passage(record["id"], record["title"], record["text"], record["metadata"], record["source"],
                          record["line"])
        span = tuple(record["span"]) if record["span"] is not None else None
        return cls(passage, record["text"], list(record["ids"]), record["block"], record["index"], span)


def split_passage(passage: Passage, template, max_tokens: int, overlap: int = 0) -> list[Chunk]:
    """Token-aware split of a passage that does not fit `max_tokens` (never truncates).

    Cuts fall on token boundaries, preferring whitespace; each chunk carries
    the passage title and its character span in the original text. With
    `overlap` > 0 each chunk after the first starts up to `overlap` tokens
    before the previous one ended (at a word start), so a fact cut in two
    is whole in one of them.
    """
    text = passage.text.strip()
    ids = template.passage_ids(passage.title, text)
    if len(ids) <= max_tokens:
        return [Chunk(passage, text, ids, template.passage_block(passage.title, text))]
    budget = max(8, max_tokens - len(template.passage_ids(passage.title, "")))
    while True:  # re-tokenising a piece with its title can merge or split a few tokens: shrink until all fit
        chunks = _chunks(passage, text, template, budget, min(overlap, budget // 2))
        if all(len(c.ids) <= max_tokens for c in chunks) or budget <= 8:
            return chunks
        budget -= max(1, budget // 16)


def _chunks(passage: Passage, text: str, template, budget: int, overlap: int) -> list[Chunk]:
    chunks = []
    for index, (a, b) in enumerate(_spans(text, template.tokenizer, budget, overlap)):
        piece = text[a:b].strip()
        chunks.append(Chunk(passage, piece, template.passage_ids(passage.title, piece),
                            template.passage_block(passage.title, piece), index, (a, b)))
    return chunks


def _spans(text: str, tokenizer, budget: int, overlap: int = 0) -> list[tuple[int, int]]:
    from cachegraft_cli.lm.plaintext import plain_encoding

    # the tokens `passage_ids` reads the text as (plain: a control string is several tokens there)
    offsets = plain_encoding(tokenizer, text).offsets
    spans, first = [], 0
    while first < len(offsets):
        last = min(first + budget, len(offsets)) - 1
        cut = _whitespace_cut(text, offsets, first, last)
        spans.append((offsets[first][0], offsets[cut][1]))
        first = cut + 1 if cut == len(offsets) - 1 else _overlap_start(text, offsets, first, cut, overlap)
    spans[-1] = (spans[-1][0], len(text))
    return spans


def _overlap_start(text: str, offsets, first: int, cut: int, overlap: int) -> int:
    """First token of the chunk after the one ending at token `cut`: the first word start among
    the last `overlap` tokens (a chunk should not open mid-word), else none repeated; past `first`."""
    for i in range(max(first + 1, cut + 1 - overlap), cut + 1):
        a = offsets[i][0]
        if text[a].isspace() or (a > 0 and text[a - 1].isspace()):
            return i
    return cut + 1


def _whitespace_cut(text: str, offsets, first: int, last: int) -> int:
    """Index of the last token of this chunk: prefer one that ends before a space."""
    if last == len(offsets) - 1:
        return last
    for i in range(last, first + (last - first) // 2, -1):
        end = offsets[i][1]
        if end < len(text) and text[end].isspace():
            return i
    return last


def _label(source: str) -> str:
    return "<stdin>" if source == "-" else source


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
    raise CorpusError(f"{_label(reader.source)}: the corpus holds no passages.",
                      "Give a corpus with at least one passage.")


def plan_chunks(passages, known: dict, template, options: EncodeOptions, summary: EncodeSummary) -> list[Chunk]:
    """The chunks to encode, as a list (a runner that ships them elsewhere); see `new_chunks`."""
    return list(new_chunks(passages, known, template, options, summary))


def new_chunks(passages, known: dict, template, options: EncodeOptions,
               summary: EncodeSummary | None = None) -> Iterator[Chunk]:
    """Every chunk of `passages` the store lacks, in corpus order, each checked against the
    store: same id, same content hash is stored already (identical text under two ids is
    stored twice); same id, other text is refused. A passage stored whole is recognised by
    its hash alone; only the others are tokenised. Counted into `summary` when given."""
    from cachegraft_cli.lm.template import passage_block
    from cachegraft_cli.store import content_hash_of

    seen: set[str] = set()
    for passage in passages:
        if summary is not None:
            summary.passages_read += 1
        if known and known.get(passage.id) == content_hash_of(passage_block(passage.title, passage.text)):
            if summary is not None:
                summary.skipped_existing += 1
            continue
        chunks = split_passage(passage, template, options.max_passage_tokens, options.chunk_overlap)
        if summary is not None:
            summary.chunks_split += len(chunks) - 1
        if chunks[0].index is None and f"{passage.id}#0" in known:  # stored split, now fits whole
            _refuse_changed(chunks[0], split=True)
        for chunk in chunks:
            _check_changed(chunk, known, chunk.content_hash)
            if known.get(chunk.id) == chunk.content_hash or chunk.id in seen:  # stored already, or a repeat
                if summary is not None:
                    summary.skipped_existing += 1
                continue
            seen.add(chunk.id)
            yield chunk


def _check_changed(chunk: Chunk, known: dict, digest: str) -> None:
    if chunk.id in known and known[chunk.id] != digest:
        _refuse_changed(chunk, split=chunk.index is not None)


def _refuse_changed(chunk: Chunk, split: bool) -> None:
    where = f"{chunk.passage.source}:{chunk.passage.line}" if chunk.passage.line else chunk.passage.source
    hint = ("; if the text is the same, it was split differently: encode with the --max-passage-tokens "
            "and --chunk-overlap the store was encoded with" if split else "")
    raise CorpusError(
        f"{where}: passage {chunk.id!r} is already in the store with different text.",
        f"Stores are append-only: give the changed passage a new id, or encode into a new --store{hint}.",
    )


def with_donors(chunks: list[Chunk]) -> list[Chunk]:
    """`chunks` with their donors set (`encoding.donors`), for a mismatched-sharer encode."""
    from cachegraft_cli.encoding.donors import donor_tokens, pick_donors

    picked = pick_donors([c.id for c in chunks], [c.passage.title for c in chunks], [len(c.ids) for c in chunks])
    for chunk, d in zip(chunks, picked):
        chunk.donor = (chunks[d].id, donor_tokens(chunks[d].ids, len(chunk.ids)))
    return chunks


def commit_windows(todo: Iterable[Chunk], options: EncodeOptions) -> Iterator[list[Chunk]]:
    """The planned chunks cut into commit windows: one segment each, whatever runner writes them.
    Streamed: only one window is held at a time."""
    window: list[Chunk] = []
    for chunk in todo:
        window.append(chunk)
        if len(window) == options.commit_every:
            yield window
            window = []
    if window:
        yield window


def with_notes_first(chunks: list[Chunk], session: ModelSession, options: EncodeOptions) -> list[Chunk]:
    """Every chunk's notes written before any is fused, in the batches `encode_window` would write
    them in (same windows, same length order), so they are the notes a plain notes run writes: a
    notes + mismatched-sharer run matches donors on passage + notes, and a donor's notes must exist."""
    from cachegraft_cli.encoding.notes import add_notes

    for window in commit_windows(chunks, options):
        for batch in _batches(window, options.batch_size):
            add_notes(batch, session, options.sharer_notes or 0)
    return chunks


def run_info(window: list[Chunk], runner: str = "local") -> dict:
    """A segment's `run_info` (the stored key `engine` names the runner, as stores have always written it)."""
    info = {"tool": "cachegraft encode", "passages": len(window)}
    return info if runner == "local" else {**info, "engine": runner}


def encode_window(window: list[Chunk], writer, session: ModelSession, options: EncodeOptions, summary,
                  progress=None) -> None:
    """Fuse one window's chunks into `writer` (not committed), in the local runner's batches:
    the same window always gives the same batches, so the same bits on the same hardware."""
    for batch in _batches(window, options.batch_size):
        _encode_batch(batch, writer, session, options, summary)
        if progress:
            progress(len(batch), sum(len(c.ids) for c in batch))


def _batches(chunks: list[Chunk], size: int) -> list[list[Chunk]]:
    ordered = sorted(chunks, key=lambda c: len(c.ids))
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def _encode_batch(batch: list[Chunk], writer, session: ModelSession, options: EncodeOptions, summary) -> None:
    from cachegraft_cli.lm import kvcache

    ratio = 1.0 if options.keep is None else options.keep
    attention = ratio < 1 and options.keep_by == "attention"  # runners resolve keep_by (`with_keep`)
    if options.sharer_notes:
        from cachegraft_cli.encoding.notes import add_notes

        add_notes(batch, session, options.sharer_notes)
    donors = [c.donor[1] for c in batch] if options.mismatched_sharer else None  # type: ignore[index]
    for chunk, kv in zip(batch, session.fusion().fuse([c.ids for c in batch], attention=attention, donors=donors)):
        caches = {"fused": kvcache.token_major(kv.fused)}  # on the fusing device: the writer quantises there
        if "own" in writer.store.kinds:
            caches["own"] = kvcache.token_major(kv.own)
        row = chunk.row()
        if ratio < 1:  # pruned after fusion: the kept tokens are the full cache's own bits
            caches, row = _pruned(kv, caches, row, ratio, options.keep_by)
        writer.add(row, caches)
        summary.added += 1
        summary.tokens += len(chunk.ids)
        summary.stored_tokens += len(caches["fused"])


def _pruned(kv, caches: dict, row, ratio: float, by: str | None) -> tuple[dict, object]:
    from dataclasses import replace

    from cachegraft_cli.encoding.keep import DEFAULT_KEEP_BY, kept_positions

    kept = kept_positions(kv, ratio, by or DEFAULT_KEEP_BY)
    return ({kind: array[kept] for kind, array in caches.items()},
            replace(row, positions=kept, span_tokens=len(caches["fused"])))
