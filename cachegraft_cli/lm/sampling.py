"""How an answer is decoded: greedy or sampled, how many tokens (no torch here: options are
built and checked before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 48
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
