"""The store a writing command targets, opened once and passed down: the encode protocol.

`encode` opens its `--store` into a `Target` before anything else: the URL is
parsed once, a local path is checked (a file, a non-empty directory that is no
store), and the metadata and manifest of an existing store are read once. Every
runner (local or Ray) takes that handle, never a URL. The runner checks it once
against what the encode asks for (`check`: codec, cache kinds, keep, sharer
input, notes; no I/O), locks it (`locked`: the writer lock, then the snapshot
brought up to date under it, since another writer may have committed or created
the store meanwhile; the one place encode locks and recovers), and finally makes
it into the store the writers write (`create`). A bad target is refused in well
under a second, before any model loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachegraft_cli.errors import StoreError, StoreMismatchError, StoreNotFoundError
from cachegraft_cli.store import segments
from cachegraft_cli.store.identity import notes_tokens, sharer_input
from cachegraft_cli.store.layout import ROOT_META
from cachegraft_cli.store.location import Location
from cachegraft_cli.store.lock import WriterLock, lock_store
from cachegraft_cli.store.store import CacheStore, half_created, read_meta


@dataclass
class Target:
    """`store` is None while no store exists at `loc` yet; `name` is the URL as the user gave it
    (what summaries and messages show)."""

    loc: Location
    store: CacheStore | None
    name: str
    # what `check` was asked, checked again when a store another writer made appears under the lock
    wanted: dict | None = None

    @classmethod
    def open(cls, url, storage_options: dict | None = None) -> Target:
        """The target at `url` (a path or URL)."""
        loc = Location.from_url(url, storage_options)
        if loc.local:
            _check_local_path(loc)
        return cls(loc, _open(loc), str(url))

    @property
    def url(self) -> str:
        return self.loc.url

    @property
    def codec(self) -> str | None:
        return self.store.identity["codec"] if self.store is not None else None

    @property
    def keep(self) -> dict | None:
        return self.store.keep if self.store is not None else None

    @property
    def notes(self) -> int:
        """Tokens of sharer notes the existing store wrote per passage (0: none, `encoding.notes`)."""
        return notes_tokens(self.store.identity) if self.store is not None else 0

    @property
    def mismatched(self) -> bool:
        """Whether the existing store is a mismatched-sharer control (`encoding.donors`)."""
        return self.store is not None and sharer_input(self.store.identity) == "mismatched"

    def check(self, codec: str | None, kinds: tuple[str, ...], keep: dict | None = None,
              compressor: str | None = None, mismatched: bool | None = None, notes: int | None = None) -> None:
        """Refuse a codec, cache kinds, keep ratio, compressor or sharer input the existing store cannot
        take (`codec`, `compressor`, `mismatched` None: the store's own; `keep` None: every token, as the
        store must have been made). A target with no store yet is checked again under the lock."""
        self.wanted = {"codec": codec, "kinds": kinds, "keep": keep, "compressor": compressor,
                       "mismatched": mismatched, "notes": notes}
        if self.store is None:
            return
        if notes is not None and notes != self.notes:
            raise StoreMismatchError(
                f"store {self.url} was made with --sharer-notes {self.notes}, but {notes} was requested.",
                hint="Leave --sharer-notes out to append as the store was made, or use another --store.")
        if mismatched is not None and mismatched != self.mismatched:
            made = "with" if self.mismatched else "without"
            raise StoreMismatchError(
                f"store {self.url} was made {made} --mismatched-sharer (its sharer input is "
                f"{sharer_input(self.store.identity)!r}).",
                hint="Leave --mismatched-sharer out to append as the store was made, or use another --store.")
        from cachegraft_cli.store.identity import check_keep, check_kinds
        from cachegraft_cli.store.layout import compressor_name

        check_keep(self.url, self.store.keep, keep)
        have = compressor_name(self.store.compressor)
        if compressor is not None and have != compressor:
            raise StoreMismatchError(
                f"store {self.url} was made with compressor={have!r}, but compressor={compressor!r} was requested.",
                hint="Leave --compressor out to append with the store's own, or use another --store.")
        stored = self.codec
        if codec is not None and stored != codec:
            raise StoreMismatchError(
                f"store {self.url} was made with codec={stored!r}, but codec={codec!r} was requested.",
                hint=f"Use --codec {stored}, or another --store.")
        check_kinds(self.url, self.store.kinds, kinds)

    @contextmanager
    def locked(self, run_info: dict) -> Iterator[WriterLock]:
        """Hold the writer lock; under it the snapshot is what other writers committed up to now
        (a store another writer created meanwhile is opened, and checked as `check` was asked).
        Writers handed this lock do not recover again: nobody else writes while it is held."""
        from cachegraft_cli.store.recover import recover

        with lock_store(self.loc, run_info) as lock:
            if self.store is None:
                self.store = _open(self.loc)
                if self.store is not None and self.wanted is not None:
                    self.check(**self.wanted)
            if self.store is not None:
                recover(self.store)  # committed-but-unlisted segments count as stored before a plan is made
                if self.store.missing:
                    raise self.store.missing_error()
            yield lock

    def create(self, identity: dict, prefix: np.ndarray, kinds: tuple[str, ...],
               compressor: str | None = None, codec_params: dict | None = None) -> CacheStore:
        """The store for `identity`: made now (with the named `compressor`, zstd by default, and
        `codec_params`), or the existing one (its identity checked against it)."""
        if self.store is None:
            from cachegraft_cli.store.layout import COMPRESSORS

            self.store = CacheStore.create(self.loc, identity, prefix, kinds, codec_params=codec_params,
                                           compressor=COMPRESSORS[compressor] if compressor else None)
        else:
            from cachegraft_cli.store import identity as ident_mod

            ident_mod.check(self.url, self.store.identity, ident_mod.validate(identity))
        return self.store


def _open(loc: Location) -> CacheStore | None:
    try:
        meta = read_meta(loc)
    except StoreNotFoundError:
        return None  # nothing there yet, or a creation that was killed: encode makes it
    store = CacheStore(loc, meta, segments.load_manifest(loc))  # a lost or malformed manifest is refused here
    if store.missing:  # a listed segment whose row table is gone: `store repair` first
        raise store.missing_error()
    return store


def _check_local_path(loc: Location) -> None:
    path = Path(loc.root)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{loc.url} is a file, not a store directory.",
                         hint="Point --store at a directory (a new one is created).")
    if path.is_dir() and not (path / ROOT_META).exists() and any(path.iterdir()) and not half_created(loc):
        raise StoreError(f"{loc.url} is a directory with other files in it, not a cache store.",
                         hint="Point --store at a new or empty directory, or at a store made by `cachegraft encode`.")
