"""Naming the passages behind a read that failed (a chunk that does not decode).

A batched read fails as a whole when one chunk fails its crc32c; reading the
passages one by one finds which of them are damaged, so the error names them
and their segment instead of surfacing zarr's "checksum do not match".
"""

from __future__ import annotations

from cachegraft_cli.errors import StoreCorruptError

_SHOWN = 5


def unreadable_passages(store, ids: list[str], kind: str, cause: BaseException) -> StoreCorruptError:
    """The typed error for a failed read of `ids`: which passages, in which segments."""
    unique = list(dict.fromkeys(ids))
    bad = [pid for pid in unique if _fails_alone(store, pid, kind)] if len(unique) > 1 else unique
    named = bad or unique
    text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    why = ("a chunk fails its crc32c" if "checksum" in text.lower()
           else f"a chunk does not decode: {text[:100].rstrip('.')}")
    return corrupt_error(store, named, kind, why)


def corrupt_error(store, ids: list[str], kind: str, why: str) -> StoreCorruptError:
    segments = sorted({store.segment_of(pid) for pid in ids if pid in store})
    shown = ", ".join(repr(p) for p in ids[:_SHOWN]) + (f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else "")
    what = "passage" if len(ids) == 1 else "passages"
    return StoreCorruptError(
        f"{what} {shown} in segment {', '.join(segments) or '?'} of {store.loc.url}: the {kind} cache is damaged "
        f"({why}).",
        hint=f"Run `cachegraft store repair {store.loc.url}` to drop them (add --reencode to encode them again), "
        "then `cachegraft index --store` it.")


def _fails_alone(store, pid: str, kind: str) -> bool:
    """Read one passage (a single-id read names it without localising again)."""
    try:
        store.read([pid], kind=kind)
    except StoreCorruptError:
        return True
    return False
