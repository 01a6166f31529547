"""The answering systems (docs/method.md section 3) and the checks of a system against a
store, which read only the store's metadata, so they run before any model loads."""

from __future__ import annotations

from cachegraft_cli.checks import one_of, text
from cachegraft_cli.errors import UsageError

# One definition, in help order: the systems answering from stored caches, then the baselines.
SYSTEMS = ("graft", "adapter", "cache", "text", "closed", "sharer-text")
CACHE_KIND = {"graft": "fused", "adapter": "fused", "cache": "own"}  # the store caches a system reads
K_FREE_SYSTEMS = ("closed",)  # answer without passages: one answer serves every k
ADAPTER_FUSER = "builtin:qwen2.5-coder-0.5b-squadshifts-qa-mix135-adapter"  # the shipped adapter (offline pair)


def check_name(system: str) -> None:
    one_of("system", system, SYSTEMS)


def check_system(store, system: str) -> None:
    """Refuse a system the store cannot serve: `graft` and `adapter` name what the store's
    fuser is, and `cache` needs the receiver's own caches."""
    check_name(system)
    url = store.loc.url
    fuser = store.identity.get("fuser") or {}
    is_adapter = fuser.get("sharer_input") == "zero"
    if system == "adapter" and not is_adapter:
        raise UsageError(f"Store {url} was not encoded with an adapter fuser.",
                         f"Encode a store with --fuser {ADAPTER_FUSER} (offline pair), or with a fuser trained "
                         "with `train-fuser --sharer-input zero`, for this system.")
    if system == "graft" and is_adapter:
        raise UsageError(f"Store {url} holds adapter caches (its fuser never saw the sharer).",
                         "Ask it with --system adapter, or use a store encoded with a sharer-fed fuser.")
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
