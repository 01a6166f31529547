"""One writer session: appends to one new segment, visible only after commit.

Order of writes (what makes a SIGKILL at any point harmless):
  1. arrays under segments/<new>/ (whole shards, flushed as they fill)
  2. rows.json, content.json, then commit.json (the segment is complete)
  3. manifest.json replaced atomically with the new segment listed
Until step 3 the segment is invisible. The next writer deletes unlisted segments
that have no commit.json and adds committed ones to the manifest (`recover.recover`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cachegraft_cli.errors import StoreError, UsageError
from cachegraft_cli.store import checksums, segments, shards
from cachegraft_cli.store.evidence import DECODES
from cachegraft_cli.store.layout import (
    COMMIT,
    CONTENT,
    array_path,
    new_segment_name,
    now_iso,
    segment_dir,
    segment_file,
)
from cachegraft_cli.store.lock import WriterLock
from cachegraft_cli.store.recover import recover
from cachegraft_cli.store.rows import PassageRow, build_table, content_columns, content_hash_of


class StoreWriter:
    """`lock`: a `WriterLock` the caller already holds for a longer session (kept at
    commit); without one the writer takes the lock itself and releases it at commit."""

    def __init__(self, store, run_info: dict | None = None, lock: WriterLock | None = None):
        self.store = store
        self.run_info = dict(run_info or {})
        self.name = new_segment_name()
        self._given_lock, self._owns_lock = lock, lock is None
        self.closed = False
        self.rows: list[PassageRow] = []
        self.spans: list[tuple[int, int]] = []
        self.crcs: list[dict] = []
        # one block buffer per kind, a whole shard long, in the codec's staging form, made at the
        # first add on that cache's device: each passage is copied in once, and a full buffer is
        # encoded there (quantised on the GPU that fused it) and written as one new shard
        self._block: dict | None = None
        self._buffered = 0
        self._positions = np.zeros(store.shard_tokens, np.int64)  # each buffered token's index in its passage
        self._written = 0
        self._arrays: dict = {}
        self._compressors = {c.dtype: shards.numcodecs_compressor(segments.compressor_for(store.compressor, c.dtype))
                             for c in store.codec.components()}
        self._hashes: set[str] = set()
        self.lock = self._acquire()

    def _acquire(self):
        """Hold the store's writer lock for the session, then recover: uncommitted unlisted segments
        out, committed ones in, the snapshot up to date. A lock the caller holds is taken as it is:
        its holder recovered on taking it (`Target.locked`), and nobody else has written since."""
        if self._given_lock is not None:
            return self._given_lock
        lock = WriterLock(self.store.loc, self.run_info).acquire()
        try:
            recover(self.store)
        except BaseException:
            if self._owns_lock:
                lock.release()
            raise
        return lock

    # -- context manager -----------------------------------------------------

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.closed:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    # -- adding ---------------------------------------------------------------

    @property
    def tokens(self) -> int:
        return self._written + self._buffered

    def has_hash(self, content_hash: str) -> bool:
        return content_hash in self._hashes or self.store.has_hash(content_hash)

    def add(self, row: PassageRow, caches: dict) -> PassageRow:
        """Buffer one passage (float32 numpy arrays, or torch tensors on any device: keep them on
        the device that fused them); whole shards are written as they fill."""
        self._check_open()
        n = self._check_caches(row, caches)
        stored = dataclasses.replace(row, tokens=n, segment=self.name, offset=self.tokens,
                                     content_hash=row.content_hash or content_hash_of(row.text),
                                     metadata=dict(row.metadata or {}))
        self.rows.append(stored)
        self.spans.append((stored.offset, stored.offset + n))
        self.crcs.append(checksums.empty(self.store.kinds, self.store.codec.components()))
        self._hashes.add(stored.content_hash)
        try:
            self._stage(caches, n)
        except BaseException:  # a half-staged passage would leave rows and shards disagreeing
            self.abort()
            raise
        return stored

    def _check_caches(self, row: PassageRow, caches: dict) -> int:
        """The passage's token count, after checking kinds and shapes (nothing is copied yet)."""
        if not isinstance(row, PassageRow) or not row.id:
            raise UsageError("add() needs a PassageRow with an id.")
        if set(caches) != set(self.store.kinds):
            raise UsageError(f"passage {row.id!r}: got caches {sorted(caches)}, the store holds "
                             f"{sorted(self.store.kinds)}.")
        want = self.store.token_shape
        shapes = {k: tuple(getattr(caches[k], "shape", np.shape(caches[k]))) for k in self.store.kinds}
        for kind, shape in shapes.items():
            if len(shape) != 5 or shape[1:] != want or shape[0] < 1:
                raise UsageError(f"passage {row.id!r}: {kind} cache has shape {shape}, expected (tokens>=1, "
                                 f"{', '.join(map(str, want))}).")
        if len({s[0] for s in shapes.values()}) != 1:
            raise UsageError(f"passage {row.id!r}: cache kinds differ in token count.")
        return shapes[self.store.kinds[0]][0]

    # -- flushing -------------------------------------------------------------

    def _stage(self, caches: dict, n: int) -> None:
        """Copy the passage into the block buffers, writing each buffer that fills as a shard."""
        block = self._make_room_for(next(iter(caches.values())))
        shard, done = self.store.shard_tokens, 0
        while done < n:
            take = min(n - done, shard - self._buffered)
            for kind, x in caches.items():
                part = x if take == n else x[done: done + take]
                self.store.codec.stage(part, block[kind][self._buffered: self._buffered + take])
            self._positions[self._buffered: self._buffered + take] = np.arange(done, done + take)
            self._buffered += take
            done += take
            if self._buffered == shard:
                self._flush()

    def _make_room_for(self, cache) -> dict:
        """Block buffers that hold `cache` exactly: made at the first add, in the codec's staging dtype
        for it on its device; widened (exactly) when a cache comes that the staging dtype would round."""
        import torch

        dtype = self.store.codec.stage_dtype(cache)
        if self._block is None:
            device = cache.device if hasattr(cache, "detach") else "cpu"
            shape = (self.store.shard_tokens,) + self.store.token_shape
            self._block = {kind: torch.empty(shape, dtype=dtype, device=device) for kind in self.store.kinds}
        elif dtype != (have := next(iter(self._block.values())).dtype) and have in (torch.bfloat16, torch.float16):
            self._block = {kind: b.to(torch.float32) for kind, b in self._block.items()}  # e.g. bf16 then fp16
        return self._block

    def _flush(self) -> None:
        if self._buffered and self._block is not None:
            self._write_block({k: b[: self._buffered] for k, b in self._block.items()},
                              self._positions[: self._buffered])
            self._buffered = 0

    def _write_block(self, block: dict, positions: np.ndarray) -> None:
        start = self._written
        stop = start + len(next(iter(block.values())))
        comps = self.store.codec.components()
        for kind, x in block.items():
            parts = self.store.codec.encode_staged(x, positions)
            for comp in comps:
                self._write_shard(kind, comp, start, parts[comp.name])
            checksums.feed(self.spans, self.crcs, kind, comps, parts, start, stop)
        self._written = stop

    def _write_shard(self, kind: str, comp, start: int, rows: np.ndarray) -> None:
        """Blocks are whole shards (the last one may be short), so each write is one new shard file."""
        per_chunk, per_shard = segments.chunk_rows(self.store, comp)
        path = array_path(self.name, kind, comp.name)
        if (kind, comp.name) not in self._arrays:
            self._arrays[(kind, comp.name)] = segments.create_array(self.store, path, comp)
        pieces = shards.shard_pieces(rows, per_chunk, per_shard // per_chunk, self._compressors[comp.dtype])
        self.store.loc.write_bytes(shards.shard_key(path, start // comp.stride // per_shard, 1 + len(comp.tail)),
                                   pieces)

    def _resize_arrays(self) -> None:
        for (_kind, part), arr in self._arrays.items():
            comp = next(c for c in self.store.codec.components() if c.name == part)
            arr.resize((comp.rows(0, self._written)[1],) + comp.tail)

    # -- commit / abort -------------------------------------------------------

    def commit(self) -> dict | None:
        """Make this session's rows visible. Returns the manifest entry (None if nothing was added)."""
        self._check_open()
        try:
            entry = self._commit() if self.rows else None
        except BaseException:
            self.abort()
            raise
        self.closed = True
        self._release()
        return entry

    def _release(self) -> None:
        if self._owns_lock:
            self.lock.release()

    def _commit(self) -> dict:
        self._flush()
        self._resize_arrays()
        loc = self.store.loc
        table = build_table(self.name, self.rows, self.crcs)
        segments.write_table(loc, table, self.store.rows_file)
        loc.write_json_atomic(segment_file(self.name, CONTENT), {"columns": content_columns(self.rows)}, compact=True)
        entry = self._entry()
        loc.write_json_atomic(segment_file(self.name, COMMIT), entry)
        self._publish(entry, table)
        return entry

    def _publish(self, entry: dict, table) -> None:
        """List the complete segment in the manifest: from here on readers see it."""
        segments.append_to_manifest(self.store.loc, entry)
        self.store.adopt(entry, table)

    def _entry(self) -> dict:
        loc = self.store.loc
        nbytes = {k: loc.size(f"{segment_dir(self.name)}/{k}") for k in self.store.kinds}
        entry = {"name": self.name, "rows": len(self.rows), "tokens": self._written, "bytes": nbytes,
                 "committed": now_iso(precise=True), "run_info": self.run_info, DECODES: self.store.decodes,
                 "plain_text": True}  # its text was tokenised with no control token parsed (lm.plaintext)
        sequence = self._sequence()
        if sequence is not None:
            entry["sequence"] = sequence
        return entry

    def _sequence(self) -> int | None:
        """The manifest generation that will list this segment (this writer holds the lock): commit
        order exactly, for a manifest rebuilt from the commit records (`segments.in_commit_order`)."""
        return int(segments.load_manifest(self.store.loc).get("generation", 0)) + 1

    def abort(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.store.loc.remove(segment_dir(self.name))
        finally:
            self._release()

    def _check_open(self) -> None:
        if self.closed:
            raise StoreError(f"the writer of segment {self.name} is already closed.")
