"""Training settings (one dataclass, recorded verbatim in the run's summary)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from cachegraft_cli.answering.assembly import (  # training matches what ask does by default
    DEFAULT_ORDER,
    DEFAULT_RECOMPUTE,
)
from cachegraft_cli.errors import TrainingError

OBJECTIVES = ("qa", "lm")
SHARER_INPUTS = ("model", "zero")
DISTRACTORS = ("retrieved", "random")


@dataclass
class TrainConfig:
    receiver: str
    sharer: str
    data: list[str]
    out: str
    objective: str = "qa"
    sharer_input: str = "model"
    sharer_notes: int = 0  # > 0: the sharer's notes (up to N tokens) follow each passage, as `encode --sharer-notes`
    val_data: list[str] = field(default_factory=list)
    seed: int = 0
    # fuser shape (docs/method.md section 1); dtype of the trained weights is float32
    hidden_dim: int = 1024
    intermediate_dim: int = 1024
    num_layers: int = 3
    dropout: float = 0.1
    # optimisation
    lr: float = 5e-4
    gate_lr: float = 2e-2
    weight_decay: float = 0.01
    warmup_steps: int = 10
    grad_clip: float = 1.0
    batch_size: int = 8
    epochs: int = 1
    max_steps: int | None = None
    max_minutes: float | None = None
    normalize_inputs: bool = True
    # data
    val_fraction: float = 0.1
    max_passages: int | None = None
    max_val_passages: int | None = 64
    max_val_items: int | None = 128
    max_passage_tokens: int = 256
    max_answer_tokens: int = 32
    passages_per_item: list[int] = field(default_factory=lambda: [1])  # qa: a mix of k, the answer's passage among k
    distractors: str = "retrieved"  # the other passages: BM25's top k for the question (as ask), or random
    order: str = DEFAULT_ORDER  # passage order in the past, as `ask --order`
    recompute: int = DEFAULT_RECOMPUTE  # boundary tokens re-read in context, as `ask --recompute`
    holdout: list[str] = field(default_factory=list)  # evaluate -B specs whose corpora are never trained on
    holdout_seed: int = 0  # the --seed the holdout evaluation samples with
    lm_fused_fraction: float = 0.5
    lm_target_tokens: int = 48
    allow_eval_sets: bool = False
    # bookkeeping
    val_every: int = 50
    save_every: int = 50
    patience: int | None = 4
    cache_dir: str | None = None
    cache_dtype: str = "bfloat16"
    resume: bool = False
    device: str | None = None
    model_dtype: str | None = "float32"
    sharer_dtype: str | None = None  # default: model_dtype (bfloat16 halves the sharer's memory while caching)
    instruction: str | None = None
    trust_remote_code: bool = False
    gate_warn_threshold: float = 0.1
    save_dtype: str = "float32"  # dtype of the shipped weights (bfloat16 halves the size)
    also_published: bool = False  # also write the published C2C layout under OUT/published
    extra: dict = field(default_factory=dict)

    def check(self) -> None:
        if self.objective not in OBJECTIVES:
            raise TrainingError(f"Unknown objective {self.objective!r}.", f"Choose one of: {', '.join(OBJECTIVES)}.")
        if self.sharer_input not in SHARER_INPUTS:
            raise TrainingError(f"Unknown sharer input {self.sharer_input!r}.", "Use --sharer-input model or zero.")
        if self.sharer_notes < 0:
            raise TrainingError(f"--sharer-notes {self.sharer_notes} is negative.",
                                "Give the notes' token limit (e.g. 48), or 0 for none.")
        if not self.data:
            raise TrainingError("No training data given.", "Pass --data FILE (SQuAD JSON, JSONL or .txt), repeatable.")
        if self.num_layers < 2:
            raise TrainingError("--num-layers must be at least 2 (docs/method.md section 1).", "Use the default 3.")
        if not 0.0 <= self.val_fraction < 1.0:
            raise TrainingError(f"--val-fraction {self.val_fraction} is outside [0, 1).", "Use e.g. 0.1.")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise TrainingError(f"Unknown save dtype {self.save_dtype!r}.", "Use float32 or bfloat16.")
        self._check_assembly()
        if self.cache_dtype not in ("float32", "bfloat16"):
            raise TrainingError(f"Unknown cache dtype {self.cache_dtype!r}.", "Use float32 or bfloat16.")

    def _check_assembly(self) -> None:
        mix = self.passages_per_item
        if isinstance(mix, int):
            mix = self.passages_per_item = [mix]
        if not mix or min(mix) < 1 or (max(mix) > 1 and self.objective != "qa"):
            raise TrainingError(f"--passages-per-item {','.join(map(str, mix))} needs values >= 1, and > 1 only with "
                                "--objective qa.",
                                "Use e.g. --objective qa --passages-per-item 1,3,5 to train for asking at k = 1-5.")
        if self.distractors not in DISTRACTORS:
            raise TrainingError(f"Unknown distractors {self.distractors!r}.", f"Use one of: {', '.join(DISTRACTORS)}.")
        from cachegraft_cli.answering.assembly import AssemblyOptions
        from cachegraft_cli.errors import UsageError

        try:
            AssemblyOptions(order=self.order, recompute=self.recompute).check()
        except UsageError as exc:
            raise TrainingError(exc.message, exc.hint) from None

    def as_dict(self) -> dict:
        return asdict(self)
