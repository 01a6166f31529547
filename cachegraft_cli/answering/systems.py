"""The answering systems (docs/method.md section 3) and the checks of a system against a
store, which read only the store's metadata, so they run before any model loads."""

from __future__ import annotations

from cachegraft_cli.checks import one_of, text
from cachegraft_cli.errors import UsageError

# One definition, in help order: the systems answering from stored caches, then the baselines.
SYSTEMS = ("graft", "adapter", "mismatched", "cache", "text", "closed", "sharer-text")
CACHE_KIND = {"graft": "fused", "adapter": "fused", "mismatched": "fused", "cache": "own"}  # the caches a system reads
K_FREE_SYSTEMS = ("closed",)  # answer without passages: one answer serves every k
ADAPTER_FUSER = "builtin:qwen2.5-coder-0.5b-squadshifts-qa-mix135-adapter"  # the shipped adapter (offline pair)


def check_name(system: str) -> None:
    one_of("system", system, SYSTEMS)


_MADE_FOR = {"zero": "adapter", "mismatched": "mismatched"}  # a store's sharer input -> the one system it serves
_HOW = {"adapter": f"Encode a store with --fuser {ADAPTER_FUSER} (offline pair), or with a fuser trained with "
                   "`train-fuser --sharer-input zero`, for this system.",
        "mismatched": "Encode a store with `cachegraft encode --mismatched-sharer` (a sharer-fed fuser) for this "
                      "system."}


def check_system(store, system: str) -> None:
    """Refuse a system the store cannot serve: `graft`, `adapter` and `mismatched` name what the
    store's fuser was fed as the sharer's cache, and `cache` needs the receiver's own caches."""
    from cachegraft_cli.store.identity import sharer_input

    check_name(system)
    url = store.loc.url
    made_for = _MADE_FOR.get(sharer_input(store.identity))
    if system in _HOW and made_for != system:
        raise UsageError(f"Store {url} was not encoded for the {system} system"
                         + (f" (it serves {made_for})." if made_for else "."), _HOW[system])
    if system == "graft" and made_for is not None:
        raise UsageError(f"Store {url} holds {made_for} caches (its fuser was not fed each passage's own "
                         "sharer cache).", f"Ask it with --system {made_for}, or use a store encoded with a "
                         "sharer-fed fuser.")
    kind = CACHE_KIND.get(system)
    if kind is not None and kind not in store.kinds:
        raise UsageError(
            f"Store {url} has no {kind!r} caches (it holds {', '.join(store.kinds)}).",
            "Re-encode with `cachegraft encode --also-own-cache` into a new store to compare with the `cache` system.",
        )


def check_question(question: str) -> str:
    """A question is a string with words in it (None, a number or blanks are refused)."""
    if isinstance(question, str) and not question.strip():
        raise UsageError("The question is empty.", "Pass a question, e.g. cachegraft ask \"Who founded the town?\".")
    return text("question", question, example='"Who founded the town?"')
