"""What one question is answered with: the system, k, the passage assembly and the decoding.
Built and checked before any model loads (no torch here). The API and the CLI check their
arguments here, so a mistake gets the same message from either."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE, DEFAULT_SCHEME, AssemblyOptions
from cachegraft_cli.answering.systems import check_name
from cachegraft_cli.checks import instance, one_of, whole
from cachegraft_cli.lm.sampling import GenerationOptions

MAX_QUESTION_BATCH = 4096  # questions decoded together; more only pads memory
INDEX_KINDS = ("bm25", "dense", "hybrid")


@dataclass
class AskOptions:
    system: str = "graft"
    k: int = 3
    scheme: str = DEFAULT_SCHEME
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    order: str = DEFAULT_ORDER
    recompute: int = DEFAULT_RECOMPUTE  # boundary tokens per passage after the first (stored-cache systems)
    blend: float = 0.0  # CacheBlend-style share of the other passage tokens recomputed (opt-in: costs a forward)
    blend_layer: int = 1

    @property
    def assembly(self) -> AssemblyOptions:
        return AssemblyOptions(self.order, self.scheme, self.recompute, self.blend, self.blend_layer)

    def check(self) -> AskOptions:
        check_name(self.system)
        whole("k (-k)", self.k, 1)
        self.assembly.check()
        instance("generation", self.generation, GenerationOptions, "Build one with cg.GenerationOptions(...), or pass "
                 "max_new_tokens, temperature, top_p and seed as keyword arguments.")
        self.generation.check()
        return self


def check_batch_size(batch_size) -> int:
    """Questions decoded together (`ask --batch-size`, `ask_many(batch_size=)`)."""
    return whole("batch_size (--batch-size)", batch_size, 1, MAX_QUESTION_BATCH)


def check_index_kind(kind) -> str | None:
    """Which half of a hybrid index to search (None: the index's own kind)."""
    return None if kind is None else one_of("index_kind (--index-kind)", kind, INDEX_KINDS)


def with_settings(options: AskOptions | None, settings: dict[str, Any]) -> AskOptions:
    """`options` (default `AskOptions()`) with `settings` (AskOptions' and GenerationOptions's field
    names) applied, checked; an unknown name is refused. `cg.ask_options` and the CLI use this."""
    from cachegraft_cli.errors import UsageError

    generation_names = {f.name for f in fields(GenerationOptions)}
    ask_names = {f.name for f in fields(AskOptions)} - {"generation"}
    unknown = sorted(set(settings) - generation_names - ask_names)
    if unknown:
        raise UsageError(f"Unknown ask option(s): {', '.join(unknown)}.",
                         f"Known: {', '.join(sorted(ask_names | generation_names))}.")
    instance("options", options, AskOptions,
             "Build one with cg.AskOptions(...), or pass the settings as keyword arguments.")
    base = (options or AskOptions()).check()  # a bad `generation` is refused before it is copied
    generation = replace(base.generation, **{k: v for k, v in settings.items() if k in generation_names})
    return replace(base, **{k: v for k, v in settings.items() if k in ask_names}, generation=generation).check()
