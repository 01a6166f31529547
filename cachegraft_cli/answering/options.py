"""What one question is answered with: the system, k, the passage assembly and the decoding.
Built and checked before any model loads (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE, DEFAULT_SCHEME, AssemblyOptions
from cachegraft_cli.answering.systems import check_name
from cachegraft_cli.errors import UsageError
from cachegraft_cli.lm.sampling import GenerationConfig


@dataclass
class AskOptions:
    system: str = "graft"
    k: int = 3
    scheme: str = DEFAULT_SCHEME
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    order: str = DEFAULT_ORDER
    recompute: int = DEFAULT_RECOMPUTE  # boundary tokens per passage after the first (stored-cache systems)
    blend: float = 0.0  # CacheBlend-style share of the other passage tokens recomputed (opt-in: costs a forward)
    blend_layer: int = 1

    @property
    def assembly(self) -> AssemblyOptions:
        return AssemblyOptions(self.order, self.scheme, self.recompute, self.blend, self.blend_layer)

    def check(self) -> None:
        check_name(self.system)
        if self.k < 1:
            raise UsageError(f"-k must be at least 1, got {self.k}.", "Use e.g. -k 3.")
        self.assembly.check()
