"""Where a training run is: saved in every checkpoint's `state.json`, restored on --resume."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

FINISHED = ("completed", "early_stopped")


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch: int = 0  # next batch of the current epoch
    best_val: float | None = None
    best_step: int | None = None
    bad_evals: int = 0  # validations in a row without improvement
    train_seconds: float = 0.0
    closed_val: float | None = None  # validation NLL of the receiver's own cache
    status: str = "running"  # running, completed, early_stopped, time_limit, interrupted

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> TrainState:
        """A saved state; keys this version does not know are ignored, missing ones default."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in saved.items() if k in known})
