"""What can be checked about a target store before any model loads or anything is written.

`encode` calls `check_target` first: a `--store` that is a file, a non-empty
directory that is no store, an existing store with another codec or without
the requested cache kinds, or a store whose manifest is lost are refused in
well under a second instead of after the models load.
"""

from __future__ import annotations

from pathlib import Path

from cachegraft_cli.errors import StoreCorruptError, StoreError, StoreMismatchError, StoreNotFoundError
from cachegraft_cli.store import segments
from cachegraft_cli.store.layout import ROOT_META, rows_file, segment_file
from cachegraft_cli.store.location import Location


def check_target(url, codec: str | None, kinds: tuple[str, ...], storage_options: dict | None = None) -> None:
    """Raise a typed error for a target `encode` cannot write into; pass for a new or fitting store.
    `codec` None: whatever the store has (an append with the store's own settings)."""
    from cachegraft_cli.store.store import half_created, read_meta

    loc = Location.from_url(url, storage_options)
    if loc.local:
        _check_local_path(loc, half_created)
    try:
        meta = read_meta(loc)
    except StoreNotFoundError:
        return  # nothing there yet, or a creation that was killed: encode makes it
    stored = meta["identity"].get("codec")
    if codec is not None and stored != codec:
        raise StoreMismatchError(f"store {loc.url} was made with codec={stored!r}, but codec={codec!r} was requested.",
                                 hint=f"Use --codec {stored}, or another --store.")
    if not set(kinds) <= set(meta.get("kinds", ())):
        raise StoreMismatchError(
            f"store {loc.url} was made without own caches, so --also-own-cache cannot add them now.",
            "Encode into a new --store with --also-own-cache to compare with the `cache` system.")
    manifest = segments.load_manifest(loc)  # a lost or malformed manifest is refused here, before anything else
    if loc.local:  # a listed segment whose row table is gone (one stat each; remote stores find it on open)
        table = rows_file(meta.get("format_version", 1))
        for entry in manifest["segments"]:
            if not loc.exists(segment_file(entry["name"], table)):
                raise StoreCorruptError(
                    f"segment {entry['name']} of {loc.url} is listed with {entry['rows']} passages, but its {table} "
                    "is missing.", hint=f"Run `cachegraft store verify {loc.url}` to see which passages, then "
                    f"`cachegraft store repair {loc.url}`.")


def _check_local_path(loc: Location, half_created) -> None:
    path = Path(loc.root)
    if path.exists() and not path.is_dir():
        raise StoreError(f"{loc.url} is a file, not a store directory.",
                         hint="Point --store at a directory (a new one is created).")
    if path.is_dir() and not (path / ROOT_META).exists() and any(path.iterdir()) and not half_created(loc):
        raise StoreError(f"{loc.url} is a directory with other files in it, not a cache store.",
                         hint="Point --store at a new or empty directory, or at a store made by `cachegraft encode`.")
