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
from dataclasses import replace

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding import calibration
from cachegraft_cli.encoding.donors import check_count, donor_identity
from cachegraft_cli.encoding.notes import notes_identity
from cachegraft_cli.encoding.plan import (
    Chunk,
    EncodeOptions,
    EncodeSummary,
    commit_windows,
    encode_window,
    new_chunks,
    run_info,
    with_donors,
    with_notes_first,
)
from cachegraft_cli.session import ModelSession
from cachegraft_cli.store.target import Target


def encode_corpus(
    passages: Iterable[Passage],
    target: Target,
    session: ModelSession,
    options: EncodeOptions,
    progress: Callable[[int, int], None] | None = None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode passages into `target` (the store the caller opened; created if missing), in the
    order of the module docstring. The target is checked here, once.

    `passages` is read more than once (plan, then write): a `CorpusReader` or a list; a
    one-shot iterator is listed first. A corpus that is already stored loads no model at
    all. `planned(n)` hears how many chunks will be encoded, once that is known;
    `progress(0, 0)` is called once when the models are loaded and encoding starts, then
    `progress(passages, tokens)` after each batch."""
    from cachegraft_cli.store.oserrors import writing

    start = time.perf_counter()
    source = list(passages) if iter(passages) is passages else passages
    codec, note = calibration.store_codec(options.codec, target.codec, session.choice.fuser)
    keep = options.keep_for(target.keep)
    target.check(codec, options.kinds, keep, options.compressor, options.mismatched_sharer,  # before the lock
                 options.sharer_notes)
    mismatched = target.mismatched if options.mismatched_sharer is None else options.mismatched_sharer
    notes = target.notes if options.sharer_notes is None else options.sharer_notes
    if mismatched and (session.choice.fuser or "closed") == "closed":
        session.check_mismatched()  # refused before any model loads
    if notes and not session.choice.sharer:
        from cachegraft_cli.errors import UsageError

        raise UsageError("--sharer-notes needs a sharer to write them, and none is named.",
                         "Name one with --sharer (or a preset).")
    options = replace(options.with_keep(keep), mismatched_sharer=mismatched, sharer_notes=notes)
    # a new store's codec tables (the tc calibration), read and checked before any model loads
    params = calibration.codec_params(codec, options.calibration, session.choice.fuser, target.store is not None)
    summary = EncodeSummary(store=target.name, fuser=session.choice.fuser or "closed", codec=codec, note=note)
    with target.locked({"tool": "cachegraft encode"}) as lock:
        stored = target.store  # up to date under the lock (another writer may have made it meanwhile)
        known = stored.content_hashes() if stored is not None else {}
        count = sum(1 for _ in new_chunks(source, known, session.template, options, summary))
        if planned:
            planned(count)
        if mismatched:
            check_count(count)  # before any model loads
        if count or stored is None or not session.names_match(stored):  # other models named: load them to check
            if stored is not None:
                session.check_template(stored)
            if mismatched:
                session.check_mismatched()
            written = session.open_or_create_store(target, codec, options.also_own_cache, keep, options.compressor,
                                                   donor_identity(mismatched), notes_identity(notes), params)
            if progress:
                progress(0, 0)
            todo = new_chunks(source, known, session.template, options)
            if mismatched:  # donors are chosen among all of this run's passages: the plan is held whole
                chunks = list(todo)
                todo = iter(with_donors(with_notes_first(chunks, session, options) if notes else chunks))
            with writing(target.name, "write the store"):
                _write(todo, written, session, options, summary, progress, lock)
    summary.seconds = round(time.perf_counter() - start, 3)
    summary.finish()
    return summary


def reencode_rows(target: Target, rows: list, session: ModelSession, options: EncodeOptions, lock) -> EncodeSummary:
    """Encode stored rows again (passages `store repair` dropped) into `target`, from their stored
    text, chunk by chunk as they were split; the caller holds the store's lock. A row whose block the loaded
    template does not reproduce (its content hash differs) is skipped and counted as bad."""
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.identity import notes_tokens, sharer_input
    from cachegraft_cli.store.oserrors import writing

    store_url = target.name
    identity = CacheStore.check_exists(store_url)["identity"]
    codec = options.codec or identity["codec"]
    mismatched = sharer_input(identity) == "mismatched"
    notes = notes_tokens(identity)
    # re-encoded rows are pruned as the store's others, fused with the donors and notes their rows record
    options = replace(options.with_keep(identity.get("keep")), mismatched_sharer=mismatched, sharer_notes=notes)
    store = session.open_or_create_store(target, codec, options.also_own_cache, identity.get("keep"),
                                         sharer_input=donor_identity(mismatched), notes=notes_identity(notes))
    summary = EncodeSummary(store=store_url)
    chunks = []
    for row in rows:
        chunk = _chunk_of_row(row, session.template)
        why = None
        if row.id in store:
            why = "stored again already"
        elif chunk.content_hash != row.content_hash:
            why = "template differs"
        elif mismatched:
            why = _set_recorded_donor(chunk, row, rows, store, session.template)
        if why:
            summary.skipped_bad += 1
            summary.skipped_reasons[row.id] = why
            continue
        chunks.append(chunk)
    summary.passages_read = len(rows)
    with writing(store_url, "write the store"):
        _write(iter(chunks), store, session, options, summary, None, lock)
    return summary


def _set_recorded_donor(chunk: Chunk, row, rows: list, store, template) -> str | None:
    """Give a re-encoded row of a mismatched-sharer store the donor its row records (read from
    the store, or from the other rows being re-encoded); the reason to skip it when there is none."""
    from cachegraft_cli.encoding.donors import donor_tokens

    donor_id = (row.metadata or {}).get("sharer_donor")
    found = [r for r in rows if r.id == donor_id] or (store.get_rows([donor_id]) if donor_id in store else [])
    if not found:
        return f"its recorded sharer donor {donor_id!r} is not in the store"
    donor = found[0]
    chunk.donor = (donor.id, donor_tokens(template.passage_ids(donor.title, donor.read_text), len(chunk.ids)))
    return None


def _chunk_of_row(row, template) -> Chunk:
    """A stored row as the chunk it was encoded from (its notes, if any, taken as they were written)."""
    from cachegraft_cli.store.rows import NOTES_KEY

    meta = dict(row.metadata or {})
    span = tuple(meta.pop("char_span")) if "char_span" in meta else None
    notes = meta.pop(NOTES_KEY, None)
    passage = Passage(row.parent_id or row.id, row.title, row.text, meta)
    return Chunk(passage, row.text, template.passage_ids(row.title, row.read_text),
                 template.passage_block(row.title, row.text), row.chunk_index, span, notes=notes)


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
