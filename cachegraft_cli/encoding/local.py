"""Corpus -> fused-cache store, in this process.

Idempotent and resumable: a passage whose content hash is already in the store
is skipped, and rows become visible only when their segment commits (every
`commit_every` passages and at the end), so an interrupted run loses at most
one uncommitted window and a re-run finishes the job without duplicates.

Order (what makes two writers, a kill or a full disk harmless, and an append cheap):
  1. the corpus is read and checked by the caller (`check_corpus`), the target
     store by `store.target.Target` (opened once and passed down): nothing is written, no model is loaded;
  2. the store's writer lock is taken (a second writer is refused at once);
  3. the plan is made against the manifest as it is once the lock is held,
     with the tokenizer alone: a corpus the store holds already loads no model;
  4. the models load (the store's own for an append), the store is created or
     opened, and the corpus is streamed again, window by window, each window
     one segment.
The corpus is never held in memory as a whole: it is read once per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.plan import (
    Chunk,
    EncodeOptions,
    EncodeSummary,
    commit_windows,
    encode_window,
    new_chunks,
    run_info,
)
from cachegraft_cli.session import ModelSession
from cachegraft_cli.store.codecs import DEFAULT_CODEC
from cachegraft_cli.store.target import Target


def encode_corpus(
    passages: Iterable[Passage],
    store: str | Target,
    session: ModelSession,
    options: EncodeOptions,
    progress: Callable[[int, int], None] | None = None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode passages into `store` (a URL, or the `Target` the caller opened; created if
    missing), in the order of the module docstring.

    `passages` is read more than once (plan, then write): a `CorpusReader` or a list; a
    one-shot iterator is listed first. A corpus that is already stored loads no model at
    all. `planned(n)` hears how many chunks will be encoded, once that is known;
    `progress(0, 0)` is called once when the models are loaded and encoding starts, then
    `progress(passages, tokens)` after each batch."""
    from cachegraft_cli.store.oserrors import writing

    start = time.perf_counter()
    source = list(passages) if iter(passages) is passages else passages
    target = Target.open(store)
    codec = options.codec or target.codec or DEFAULT_CODEC
    keep = options.keep_for(target.keep)
    target.check(codec, options.kinds, keep, options.compressor)  # codec, kinds, keep, compressor: before the lock
    options = options.with_keep(keep)
    summary = EncodeSummary(store=target.name, fuser=session.choice.fuser or "closed")
    with target.locked({"tool": "cachegraft encode"}) as lock:
        stored = target.store  # up to date under the lock (another writer may have made it meanwhile)
        known = stored.content_hashes() if stored is not None else {}
        count = sum(1 for _ in new_chunks(source, known, session.template, options, summary))
        if planned:
            planned(count)
        if count or stored is None or not session.names_match(stored):  # other models named: load them to check
            if stored is not None:
                session.check_template(stored)
            written = session.open_or_create_store(target, codec, options.also_own_cache, keep, options.compressor)
            if progress:
                progress(0, 0)
            with writing(target.name, "write the store"):
                _write(new_chunks(source, known, session.template, options), written, session, options, summary,
                       progress, lock)
    summary.seconds = round(time.perf_counter() - start, 3)
    summary.finish()
    return summary


def reencode_rows(store_url: str, rows: list, session: ModelSession, options: EncodeOptions, lock) -> EncodeSummary:
    """Encode stored rows again (passages `store repair` dropped), from their stored text, chunk by
    chunk as they were split; the caller holds the store's lock. A row whose block the loaded
    template does not reproduce (its content hash differs) is skipped and counted as bad."""
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.oserrors import writing

    identity = CacheStore.check_exists(store_url)["identity"]
    codec = options.codec or identity["codec"]
    options = options.with_keep(identity.get("keep"))  # re-encoded rows are pruned as the store's others
    store = session.open_or_create_store(store_url, codec, options.also_own_cache, identity.get("keep"))
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
    return Chunk(passage, row.text, template.passage_ids(row.title, row.text),
                 template.passage_block(row.title, row.text), row.chunk_index, span)


def _write(chunks: Iterable[Chunk], store, session: ModelSession, options: EncodeOptions, summary, progress,
           lock=None) -> None:
    """Encode in commit windows; each window is one segment, visible once committed. `lock`:
    the writer lock the caller holds for the whole run."""
    for window in commit_windows(chunks, options):
        with store.writer(run_info(window), lock=lock) as writer:
            encode_window(window, writer, session, options, summary, progress)
            entry = writer.commit()
        if entry:
            summary.segments.append(entry["name"])
            summary.bytes += sum(entry["bytes"].values())
