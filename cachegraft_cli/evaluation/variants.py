"""System labels with assembly overrides: `SYSTEM[@key=value]...`.

One evaluation can answer the same system under several assemblies, e.g.
`text@order=retrieval` next to `text` (the run's order), or
`graft@recompute=16@order=retrieval` next to the default `graft`. Store keys
answer from another store of the same corpus: `graft@keep=0.5` (a pruned
store), `graft@codec=int4`, `graft@keep=0.5@keep_by=even`, `text@notes=48` (a store
with the sharer's notes, `encode --sharer-notes`); each such store is
encoded once and reused. The label is what answers, scores and comparisons are
keyed by; the base system and the overrides are what the answerer runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cachegraft_cli.answering.systems import SYSTEMS as BASE_SYSTEMS
from cachegraft_cli.errors import UsageError

# override key -> type of its value
ASSEMBLY_KEYS = {"order": str, "scheme": str, "recompute": int, "blend": float, "blend_layer": int}
STORE_KEYS = {"codec": str, "keep": float, "keep_by": str, "notes": int}  # which store answers (encode options)
KEYS = {**ASSEMBLY_KEYS, **STORE_KEYS}
BEST_TEXT = "text (best order)"  # per benchmark and k, the text variant with the best EM (then F1)


@dataclass(frozen=True)
class Variant:
    label: str
    system: str
    overrides: dict = field(default_factory=dict)

    @property
    def assembly(self) -> dict:
        return {k: v for k, v in self.overrides.items() if k in ASSEMBLY_KEYS}

    @property
    def store(self) -> dict:
        return {k: v for k, v in self.overrides.items() if k in STORE_KEYS}


def parse_variant(label: str) -> Variant:
    """`graft@recompute=0@order=retrieval` -> Variant(label, "graft", {"recompute": 0, "order": "retrieval"})."""
    system, *parts = label.split("@")
    if system not in BASE_SYSTEMS:
        raise UsageError(f"Unknown system {system!r} in {label!r}.", f"Choose among {', '.join(BASE_SYSTEMS)}.")
    overrides = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in KEYS:
            raise UsageError(
                f"Bad system option {part!r} in {label!r}.",
                f"Write SYSTEM@key=value with keys {', '.join(KEYS)}, e.g. text@order=retrieval.",
            )
        try:
            overrides[key] = KEYS[key](value)
        except ValueError:
            raise UsageError(
                f"Bad value {value!r} for {key} in {label!r}.", f"{key} takes a {KEYS[key].__name__}."
            ) from None
    return Variant(label, system, overrides)


def check_variant(label: str) -> Variant:
    """Parse and check the overrides' values (before any model loads)."""
    from dataclasses import replace

    from cachegraft_cli.answering.assembly import AssemblyOptions
    from cachegraft_cli.encoding.plan import EncodeOptions

    variant = parse_variant(label)
    replace(AssemblyOptions(), **variant.assembly).check()
    store = dict(variant.store)
    notes = store.pop("notes", None)
    EncodeOptions(**store, sharer_notes=notes)  # codec, keep, keep_by and notes checked as encode checks them
    return variant


def base_system(label: str) -> str:
    return label.split("@", 1)[0]
