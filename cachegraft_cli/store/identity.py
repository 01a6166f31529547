"""What produced a store's caches, and comparing that with what a caller expects."""

from __future__ import annotations

import json
from typing import Any

from cachegraft_cli.errors import StoreMismatchError, UsageError
from cachegraft_cli.store.codecs import check_codec
from cachegraft_cli.store.layout import IDENTITY_KEYS


def normalise(identity: dict) -> dict:
    """JSON round trip: tuples become lists, numpy ints plain ints, so equality is by value."""
    return json.loads(json.dumps(identity, default=_plain))


def _plain(obj: Any):
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"identity value {obj!r} is not JSON-serialisable")


def validate(identity: dict) -> dict:
    missing = [k for k in IDENTITY_KEYS if k not in identity]
    if missing:
        raise UsageError(f"store identity lacks {', '.join(missing)}.",
                         hint=f"Pass all of: {', '.join(IDENTITY_KEYS)} (None where not applicable).")
    ident = normalise({k: v for k, v in identity.items() if k != "format_version"})
    geometry = ident["geometry"]
    if not isinstance(geometry, dict) or not all(isinstance(geometry.get(k), int) and geometry[k] > 0
                                                  for k in ("layers", "kv_heads", "head_dim")):
        raise UsageError(f"store geometry must give positive ints layers, kv_heads, head_dim; got {geometry!r}.")
    check_codec(ident["codec"], geometry)  # unknown codec or unfit geometry fails here
    return ident


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def _first_difference(stored: Any, wanted: Any, path: str) -> str:
    if isinstance(stored, dict) and isinstance(wanted, dict):
        for key in sorted(set(stored) | set(wanted)):
            if stored.get(key) != wanted.get(key):
                return _first_difference(stored.get(key), wanted.get(key), f"{path}.{key}")
    return path


def check(url: str, stored: dict, expect: dict | None) -> None:
    """Raise StoreMismatchError naming the first key where `expect` differs from the store."""
    for key, wanted in normalise(expect or {}).items():
        if key == "format_version":  # how the store is laid out, not what made its caches
            continue
        have = stored.get(key)
        if have != wanted:
            where = _first_difference(have, wanted, key)
            raise StoreMismatchError(
                f"store {url} was made with {key}={show(have)}, but {key}={show(wanted)} was requested"
                + (f" (they differ at {where})." if where != key else "."),
                hint=f"Use another --store, or the models and settings this store was made with "
                f"(see `cachegraft store info {url}`).",
            )


def sharer_input(identity: dict) -> str:
    """What a store's fuser was fed as the sharer's cache: "model" (the passage's own), "zero" (an
    adapter), "mismatched" (another passage's, `encoding.donors`), or "none" (no fuser)."""
    fuser = identity.get("fuser")
    return "none" if not fuser else fuser.get("sharer_input", "model")


def notes_tokens(identity: dict) -> int:
    """Tokens of sharer notes a store wrote per passage (`encode --sharer-notes`; 0: none)."""
    return int((identity.get("notes") or {}).get("tokens", 0))


def keep_entry(ratio: float | None, by: str) -> dict | None:
    """The identity's `keep` for a keep ratio: None (the key absent, as in every store written
    before pruning existed) when every token is stored."""
    return None if ratio is None or ratio >= 1 else {"ratio": float(ratio), "by": by}


def describe_keep(keep: dict | None) -> str:
    return "1 (every token)" if keep is None else f"{keep['ratio']:g} (by {keep['by']})"


def check_kinds(url: str, stored: tuple[str, ...], wanted: tuple[str, ...], exact: bool = False) -> None:
    """The cache kinds a store holds against those asked for (`exact`: the same set; otherwise an
    append may leave out the own caches a store keeps, and writes them anyway)."""
    if set(wanted) <= set(stored) and (not exact or set(wanted) == set(stored)):
        return
    made = "without own caches" if "own" not in stored else "with own caches"
    raise StoreMismatchError(f"store {url} was made {made} (cache kinds {sorted(stored)}), but {sorted(wanted)} "
                             "were requested.",
                             hint="Encode into a new --store with --also-own-cache to compare with the `cache` "
                                  "system, or ask for the cache kinds the store was made with.")


def check_keep(url: str, stored: dict | None, wanted: dict | None) -> None:
    """A store is pruned one way throughout: refuse an append that asks for another keep."""
    if normalise(stored or {}) == normalise(wanted or {}):
        return
    hint = (f"Pass --keep {stored['ratio']:g} --keep-by {stored['by']} (or no --keep: the store's is used)"
            if stored is not None else "Drop --keep: this store keeps every token")
    raise StoreMismatchError(f"store {url} was made with --keep {describe_keep(stored)}, but --keep "
                             f"{describe_keep(wanted)} was requested.", hint=f"{hint}, or encode into another --store.")
