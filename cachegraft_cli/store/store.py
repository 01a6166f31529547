"""`CacheStore`: create/open a store, look passages up, read their caches lazily."""

from __future__ import annotations

import bisect
import math
import os

import numpy as np

from cachegraft_cli.errors import (
    StoreCorruptError,
    StoreError,
    StoreMetadataError,
    StoreMismatchError,
    StoreNotFoundError,
    UsageError,
)
from cachegraft_cli.store import checksums, evidence, identity as ident_mod, segments
from cachegraft_cli.store.codecs import Codec, get_codec, raw_bf16_bytes_per_token
from cachegraft_cli.store.counting import CountingStore, ReadStats
from cachegraft_cli.store.layout import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_COMPRESSOR,
    FORMAT_VERSION,
    PREFIX,
    ROOT_META,
    array_path,
    default_shard_tokens,
    is_temp,
    now_iso,
    rows_file,
)
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.rows import PassageRow, SegmentTable


class CacheStore:
    """A snapshot of a store taken at open: committed segments only."""

    def __init__(self, loc: Location, meta: dict, manifest: dict):
        self.loc = loc
        self.meta = meta
        self.identity: dict = meta["identity"]
        self.kinds: tuple[str, ...] = tuple(meta["kinds"])
        self.geometry: dict = self.identity["geometry"]
        self.codec = get_codec(self.identity["codec"], self.geometry, meta.get("codec_params"), stored=True)
        self.codec.bind(loc)
        self.chunk_tokens: int = meta["chunk_tokens"]
        self.shard_tokens: int = meta["shard_tokens"]
        self.compressor: dict = meta["compressor"]
        self.decodes = evidence.decode_spec(meta, self.codec)  # what each segment must have been written with
        self.expect = evidence.ArrayExpectation(self)
        self.stats = ReadStats()
        self._zstores: dict[bool, object] = {}
        self._arrays: dict[tuple, object] = {}
        self._entries: list[dict] = []
        self._tables: list[SegmentTable] = []
        self._at: dict[str, int] = {}  # segment name -> its index in _entries / _tables
        self._where: dict[str, int] = {}  # id -> global row (plain ints: half the build time of tuples)
        self._bases: list[int] = []  # global row of each table's first row
        self._hashes: set[bytes] | None = None  # built on first has_hash (encode planning only)
        self.rows_file = rows_file(meta.get("format_version", 1))
        self.missing: dict[str, str] = {}  # listed segments whose row table does not read: {name: why}
        self._listed = [s["name"] for s in manifest["segments"]]
        tables, self.missing = segments.load_tables_tolerant(loc, self._listed, self.rows_file)
        for entry, table in zip(manifest["segments"], tables):
            self.adopt(entry, table)

    # -- create / open ----------------------------------------------------------

    @classmethod
    def create(cls, url, identity: dict, prefix: np.ndarray, kinds=("fused",), *, chunk_tokens: int | None = None,
               shard_tokens: int | None = None, compressor: dict | None = None, codec_params: dict | None = None,
               storage_options: dict | None = None) -> "CacheStore":
        """Make a new store; if one exists with the same identity and kinds, open it instead."""
        ident = ident_mod.validate(identity)
        kinds = tuple(kinds)
        loc = Location.from_url(url, storage_options)
        if _store_exists(loc):
            store = cls.open(url, expect=ident, storage_options=storage_options)
            ident_mod.check_kinds(store.loc.url, store.kinds, kinds, exact=True)
            return store
        if "fused" not in kinds or len(set(kinds)) != len(kinds):
            raise UsageError(f"cache kinds must be distinct and include 'fused'; got {list(kinds)}.")
        prefix = _check_prefix(prefix, ident)
        meta, codec = _new_meta(ident, kinds, chunk_tokens, shard_tokens, compressor, codec_params)
        if loc.local:
            os.makedirs(loc.root, exist_ok=True)
        codec.install(loc)  # store-level codec tables before the root metadata that names them
        _write_new_store(loc, meta, prefix)
        return cls.open(url, storage_options=storage_options)

    @classmethod
    def open(cls, url, expect: dict | None = None, storage_options: dict | None = None,
             partial: bool = False) -> "CacheStore":
        """A snapshot of the store. A listed segment whose row table does not read is refused
        (`StoreCorruptError`, pointing at `store repair`) unless `partial`: readers (`ask`,
        `verify`) then go on with the other segments, and `missing` names it."""
        loc = Location.from_url(url, storage_options)
        meta = read_meta(loc)
        ident_mod.check(loc.url, meta["identity"], expect)
        for _ in range(3):  # a writer that replaced the manifest meanwhile (compaction): take the new one
            manifest = segments.load_manifest(loc)
            store = cls(loc, meta, manifest)
            if not store.missing or segments.load_manifest(loc)["segments"] == manifest["segments"]:
                break
        if store.missing and not partial:
            raise store.missing_error()
        return store

    def missing_error(self, passage_id: str | None = None) -> StoreCorruptError:
        """The typed error for listed segments that do not read (and a passage looked for there)."""
        name, why = next(iter(self.missing.items()))
        entry = next(e for e in self._entries if e["name"] == name)
        more = f" (and {len(self.missing) - 1} more segments)" if len(self.missing) > 1 else ""
        lead = f"passage {passage_id!r} cannot be read: " if passage_id is not None else ""
        return StoreCorruptError(
            f"{lead}segment {name} of {self.loc.url} is listed with {entry['rows']} passages, but {why}{more}.",
            hint=f"Run `cachegraft store verify {self.loc.url}` to see which passages, then "
                 f"`cachegraft store repair {self.loc.url}` (it keeps what is left of the segment aside).")

    def refresh(self) -> CacheStore:
        """Catch up with the manifest as it is now (a writer calls this once it holds the lock,
        so it plans against what other writers committed meanwhile)."""
        manifest = segments.load_manifest(self.loc)
        names = [s["name"] for s in manifest["segments"]]
        mine = [e["name"] for e in self._entries]
        if names[:len(mine)] != mine or self.missing:  # segments were replaced (repair, compaction): start over
            self.__init__(self.loc, self.meta, manifest)  # type: ignore[misc]
            return self
        new = manifest["segments"][len(mine):]
        for entry, table in zip(new, segments.load_tables(self.loc, [e["name"] for e in new], self.rows_file)):
            self.adopt(entry, table)
            self._listed.append(entry["name"])
        return self

    def moved_on(self) -> bool:
        """Whether the manifest lists other segments than this snapshot read (a compaction or repair
        since): a read that failed may then have lost a race, not met damage."""
        try:
            names = [s["name"] for s in segments.load_manifest(self.loc)["segments"]]
        except StoreError:
            return False
        return names != self._listed

    @staticmethod
    def check_exists(url, storage_options: dict | None = None) -> dict:
        """The store's metadata, read without opening its segments; StoreNotFoundError (with its hint) if none."""
        return read_meta(Location.from_url(url, storage_options))

    # -- passages ---------------------------------------------------------------

    def adopt(self, entry: dict, table: SegmentTable) -> None:
        """Add one committed segment to this snapshot (on open, and after our own commit)."""
        evidence.check_entry(self.loc.url, entry, self.decodes)
        evidence.check_table(self.loc.url, table, self.kinds, self.codec.components())
        base = self._bases[-1] + len(self._tables[-1]) if self._tables else 0
        self._at[entry["name"]] = len(self._entries)
        self._entries.append(entry)
        self._tables.append(table)
        self._bases.append(base)
        self._where.update(zip(table.ids, range(base, base + len(table))))
        if self._hashes is not None:
            self._hashes.update(table.hashes.tolist())

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, passage_id: str) -> bool:
        return passage_id in self._where

    def ids(self) -> list[str]:
        return list(self._where)

    def has_hash(self, content_hash: str) -> bool:
        if self._hashes is None:
            self._hashes = {h for t in self._tables for h in t.hashes.tolist()}
        return content_hash.encode("ascii", "replace") in self._hashes

    def rows(self, segment_names: list[str] | None = None) -> list[PassageRow]:
        """Committed rows of the snapshot (or of the named segments only); an id written
        again in a later segment shows its latest row."""
        wanted = None if segment_names is None else {t.segment for t in self._tables} & set(segment_names)
        tables = [t for t in self._tables if wanted is None or t.segment in wanted]
        segments.load_content(self.loc, tables)
        found = map(self._split, self._where.values())
        return [self._tables[ti].row(ri) for ti, ri in found if wanted is None or self._tables[ti].segment in wanted]

    def content_hashes(self) -> dict[str, str]:
        """id -> content hash of every committed row, from the index tables only (no text is read)."""
        return {pid: self._tables[ti].content_hash(ri) for pid, (ti, ri) in
                zip(self._where, map(self._split, self._where.values()))}

    def get_rows(self, ids: list[str]) -> list[PassageRow]:
        try:
            return self._get_rows(ids)
        except (OSError, StoreError):
            if not self.moved_on():  # see `read`
                raise
        self.refresh()
        return self._get_rows(ids)

    def _get_rows(self, ids: list[str]) -> list[PassageRow]:
        found = [self._locate(pid) for pid in ids]
        segments.load_content(self.loc, [self._tables[ti] for ti in sorted({ti for ti, _ in found})])
        return [self._tables[ti].row(ri) for ti, ri in found]

    def _locate(self, passage_id: str) -> tuple[int, int]:
        try:
            return self._split(self._where[passage_id])
        except KeyError:
            if self.missing:  # it may be in a segment whose rows cannot be read
                raise self.missing_error(passage_id) from None
            raise StoreError(f"passage {passage_id!r} is not in store {self.loc.url}.",
                             hint=f"List what it holds with `cachegraft store info {self.loc.url}`.") from None

    def _split(self, row: int) -> tuple[int, int]:
        """Global row -> (table, row in table)."""
        ti = bisect.bisect_right(self._bases, row) - 1
        return ti, row - self._bases[ti]

    @property
    def segments(self) -> list[dict]:
        return list(self._entries)

    @property
    def tables(self) -> list[SegmentTable]:
        """The row tables of the committed segments, in segment order (read-only use)."""
        return list(self._tables)

    @property
    def token_shape(self) -> tuple[int, ...]:
        g = self.geometry
        return (g["layers"], 2, g["kv_heads"], g["head_dim"])

    @property
    def prefix_token_ids(self) -> list[int]:
        return list(self.identity.get("prefix_token_ids") or [])

    @property
    def stats_bytes_read(self) -> int:
        return self.stats.bytes

    # -- reading ----------------------------------------------------------------

    def prefix(self) -> np.ndarray:
        import zarr

        return np.asarray(zarr.open_array(store=self.zarr_store(), path=PREFIX, mode="r")[...], dtype=np.float32)

    def read(self, ids: list[str], kind: str = "fused", check: bool = True) -> list[np.ndarray]:
        """Decoded float32 caches `(tokens, layers, 2, kv_heads, head_dim)`, touching only their chunks.
        A read that fails after a writer replaced segments this snapshot lists (compaction with no
        grace, repair) is not damage: the snapshot catches up with the manifest and reads again."""
        try:
            return self._read(ids, kind, check)
        except Exception:  # damage, or the files of a segment a writer removed meanwhile
            if not self.moved_on():
                raise
        self.refresh()
        return self._read(ids, kind, check)

    def _read(self, ids: list[str], kind: str, check: bool) -> list[np.ndarray]:
        if kind not in self.kinds:
            raise StoreError(f"store {self.loc.url} has no {kind!r} caches (it holds {', '.join(self.kinds)}).",
                             hint="Re-encode into a store made with that cache kind.")
        found = [self._locate(pid) for pid in ids]
        comps = self.codec.components()
        spans = [self._tables[ti].span(ri) for ti, ri in found]
        try:
            requests = [(self.array(self._tables[ti].segment, kind, c.name), c.rows(*span))
                        for (ti, _), span in zip(found, spans) for c in comps]
        except StoreMetadataError:
            raise
        except Exception as exc:  # noqa: BLE001 - an array whose metadata is gone: name the passages
            from cachegraft_cli.store.damage import corrupt_error

            raise corrupt_error(self, ids, kind, f"its arrays do not open: {str(exc).splitlines()[0][:120]}") from None
        try:
            flat = _read_ranges(requests)
        except Exception as exc:  # noqa: BLE001 - a chunk that fails to decode: name the passages it holds
            from cachegraft_cli.store.damage import unreadable_passages

            raise unreadable_passages(self, ids, kind, exc) from None
        reads = []
        for n, ((ti, ri), span) in enumerate(zip(found, spans)):
            parts = {c.name: flat[n * len(comps) + j] for j, c in enumerate(comps)}
            if check:
                self._check_passage(ti, ri, kind, parts)
            reads.append((parts, *span))
        return self.codec.decode_many(reads)

    @property
    def keep(self) -> dict | None:
        """How a pruned store chose its tokens (`{"ratio": R, "by": method}`); None: every token is stored."""
        return self.identity.get("keep")

    def positions(self, ids: list[str]) -> list[tuple[np.ndarray, int] | None]:
        """Per passage of a pruned store: its stored tokens' positions in the passage, and the
        passage's token count before pruning; None for a passage stored whole. From the row
        tables alone (no cache or text is read)."""
        out: list[tuple[np.ndarray, int] | None] = []
        for ti, ri in (self._locate(pid) for pid in ids):
            table = self._tables[ti]
            kept = table.positions(ri)
            if kept is None or table.span_tokens is None:
                if self.keep is not None:  # a pruned store's row without positions would be misplaced: refuse
                    raise StoreCorruptError(
                        f"store {self.loc.url}: segment {table.segment} of a pruned store (keep "
                        f"{self.keep['ratio']}) records no kept positions for passage {table.ids[ri]!r}.",
                        hint="Run `cachegraft store verify`; re-encode the passage with the store's --keep.")
                out.append(None)
            else:
                out.append((np.asarray(kept, dtype=np.int64), int(table.span_tokens[ri])))
        return out

    def _check_passage(self, ti: int, ri: int, kind: str, parts: dict) -> None:
        table = self._tables[ti]
        if checksums.of_parts(parts, self.codec.components()) != table.checksum(ri, kind):
            from cachegraft_cli.store.damage import corrupt_error

            raise corrupt_error(self, [table.ids[ri]], kind, "it fails its checksum; a shard may be missing")

    def segment_of(self, passage_id: str) -> str:
        """The segment holding a passage's current row."""
        return self._tables[self._locate(passage_id)[0]].segment

    def array(self, segment: str, kind: str, part: str):
        """The zarr array of one segment's cache part (opened once, read lazily), after checking its
        metadata against the store's (`evidence`: a `StoreMetadataError` names what contradicts)."""
        key = (segment, kind, part)
        if key not in self._arrays:
            arr = self._open_array(segment, kind, part)
            if segment in self._at:  # a listed segment: its entry and table say what the array must be
                at = self._at[segment]
                evidence.check_array(self.loc.url, self.expect, arr, self._component(part), self._entries[at],
                                     self._tables[at], kind)
            self._arrays[key] = arr
        return self._arrays[key]

    def _open_array(self, segment: str, kind: str, part: str):
        path = array_path(segment, kind, part)
        try:
            return segments.open_array(self.zarr_store(), path)
        except Exception as exc:
            if segment not in self._at or not self.loc.exists(f"{path}/c"):
                raise  # no shard either: the part is gone, which is damage
            entry = self._entries[self._at[segment]]
            raise evidence.array_refusal(self.loc.url, entry, kind, self._component(part),
                                         str(exc).splitlines()[0][:120]) from None

    def _component(self, part: str):
        return next(c for c in self.codec.components() if c.name == part)

    def zarr_store(self, writable: bool = False):
        if writable not in self._zstores:
            base = self.loc.zarr_store(read_only=not writable)
            self._zstores[writable] = base if writable else CountingStore(base, self.stats)
        return self._zstores[writable]

    # -- writing, reporting -----------------------------------------------------

    def writer(self, run_info: dict | None = None, lock=None):
        """A writer session; `lock` is a `WriterLock` already held (see `lock.lock_store`)."""
        from cachegraft_cli.store.writer import StoreWriter

        return StoreWriter(self, run_info, lock)

    def info(self) -> dict:
        from cachegraft_cli.store.report import info

        return info(self)

    def verify(self, progress=None) -> dict:
        from cachegraft_cli.store.verify import verify

        return verify(self, progress)


def _read_ranges(requests: list) -> list[np.ndarray]:
    """Read all (array, (lo, hi)) row ranges concurrently."""
    import asyncio

    from zarr.core.sync import sync

    async def gather():
        return await asyncio.gather(*(arr._async_array.getitem((slice(lo, hi),)) for arr, (lo, hi) in requests))

    return [np.asarray(a) for a in sync(gather())]


def read_meta(loc: Location) -> dict:
    """The store metadata in the root zarr.json (typed errors for what is not a store)."""
    try:
        root = loc.read_json(ROOT_META)
    except FileNotFoundError:
        raise StoreNotFoundError(
            f"no cache store at {loc.url}.",
            hint=f"Run `cachegraft encode CORPUS --store {loc.url}` first, or check the path.",
        ) from None
    except (NotADirectoryError, IsADirectoryError, ValueError):
        raise StoreError(f"{loc.url} is not a cache store (it is a file, or its zarr.json is not JSON).",
                         hint="Point --store at a directory made by `cachegraft encode`.") from None
    meta = root.get("attributes", {}).get("cachegraft") if isinstance(root, dict) else None
    if not meta and half_created(loc):
        raise StoreNotFoundError(f"the creation of the store at {loc.url} was interrupted before it finished.",
                                 hint=f"Run `cachegraft encode CORPUS --store {loc.url}` to create it again.")
    if not meta:
        raise StoreNotFoundError(f"{loc.url} is a zarr group but not a cache store.",
                                 hint="Point --store at a directory made by `cachegraft encode`.")
    version = meta.get("format_version", 0) if isinstance(meta, dict) else 0
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise StoreMismatchError(f"store {loc.url} has format_version={version}, "
                                 f"this cachegraft reads up to {FORMAT_VERSION}.", hint="Upgrade cachegraft.")
    evidence.check_meta(loc.url, meta)
    return meta


def _store_exists(loc: Location) -> bool:
    """True for a store; False for nothing or a creation that was killed before its root was written."""
    if not loc.exists(ROOT_META):
        return False
    if loc.read_json(ROOT_META).get("attributes", {}).get("cachegraft"):
        return True
    if segments.load_manifest(loc)["segments"]:
        raise StoreError(f"{loc.url} holds segments but its zarr.json does not describe a cache store.",
                         hint="Restore zarr.json from a backup, or use another --store.")
    if not half_created(loc):
        raise StoreError(f"{loc.url} is a zarr group but not a cache store.", hint="Use another --store.")
    return False


def half_created(loc: Location) -> bool:
    """Only what a store creation killed before its root metadata leaves behind (made again on create)."""
    from cachegraft_cli.store.layout import LOCK, MANIFEST, SEGMENTS

    names = {n for n in loc.list_names("") if not is_temp(n)}
    return names <= {ROOT_META, PREFIX, MANIFEST, LOCK, SEGMENTS, "codec"} and not loc.list_names(SEGMENTS)


def _check_prefix(prefix, ident: dict) -> np.ndarray:
    g = ident["geometry"]
    prefix = np.asarray(prefix, dtype=np.float32)
    want = (g["layers"], 2, g["kv_heads"], g["head_dim"])
    if prefix.ndim != 5 or prefix.shape[1:] != want:
        raise UsageError(f"prefix cache has shape {prefix.shape}, expected (tokens, {', '.join(map(str, want))}).")
    ids = ident.get("prefix_token_ids")
    if ids is not None and len(ids) != len(prefix):
        raise UsageError(f"prefix cache has {len(prefix)} tokens but prefix_token_ids has {len(ids)}.")
    return prefix


def _new_meta(ident, kinds, chunk_tokens, shard_tokens, compressor, codec_params) -> tuple[dict, Codec]:
    chunk = int(chunk_tokens or DEFAULT_CHUNK_TOKENS)
    codec = get_codec(ident["codec"], ident["geometry"], codec_params)
    strides = [c.stride for c in codec.components()] + [chunk]
    step = math.lcm(*strides)  # a default shard must hold whole token groups too (int4 key groups)
    shard = int(
        shard_tokens or -(-default_shard_tokens(raw_bf16_bytes_per_token(ident["geometry"]), chunk) // step) * step
    )
    if chunk < 1 or any(shard % s for s in strides):
        raise UsageError(f"shard_tokens={shard} must be a multiple of chunk_tokens={chunk} and of every codec group "
                         f"{strides}.")
    return {"format_version": codec.format_version(), "identity": ident, "kinds": list(kinds), "chunk_tokens": chunk,
            "shard_tokens": shard, "compressor": dict(compressor or DEFAULT_COMPRESSOR), "codec_params": codec.params,
            "created": now_iso()}, codec


def _write_new_store(loc: Location, meta: dict, prefix: np.ndarray) -> None:
    """Prefix and empty manifest first, the root zarr.json last: a store exists once that is written."""
    import zarr

    from cachegraft_cli.store.layout import MANIFEST

    if loc.local:
        os.makedirs(loc.root, exist_ok=True)
    for name in loc.list_names(""):  # temp files of a creation that was killed
        if is_temp(name):
            loc.remove(name)
    zstore = loc.zarr_store(read_only=False)
    arr = zarr.create_array(store=zstore, name=PREFIX, shape=prefix.shape, dtype="float32",
                            chunks=prefix.shape if len(prefix) else (1,) + prefix.shape[1:], overwrite=True)
    arr[...] = prefix
    if not loc.exists(MANIFEST):
        loc.write_json_atomic(MANIFEST, segments.empty_manifest(meta["format_version"]))
    loc.write_json_atomic(ROOT_META, {"zarr_format": 3, "node_type": "group", "attributes": {"cachegraft": meta}})
