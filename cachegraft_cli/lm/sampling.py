"""How an answer is decoded: greedy or sampled, how many tokens (no torch here: options are
built and checked before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass

from cachegraft_cli.checks import number, optional_whole, probability, whole
from cachegraft_cli.errors import UsageError
from cachegraft_cli.lm.drafting import DRAFT_TOKENS, MAX_DRAFT_TOKENS

# Below this a float32 softmax of logits / temperature can overflow to inf and sample NaNs.
MIN_TEMPERATURE = 1e-3
# Above this sampling is uniform to float precision anyway; a bound keeps an int such as 10**400 (which
# no tensor can divide by) from reaching the decoder after the model has loaded.
MAX_TEMPERATURE = 1e3
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64-bit seeds


@dataclass
class GenerationOptions:
    """How one answer is decoded (a call's choices, carried in `AskOptions.generation`)."""

    max_new_tokens: int = 48
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    # greedy answers check up to this many tokens copied from the prompt per step (`lm/drafting.py`);
    # 0 decodes one token per step
    draft_tokens: int = DRAFT_TOKENS

    def check(self) -> GenerationOptions:
        """Refuse a setting decoding cannot use (the API and the CLI share these messages)."""
        whole("max_new_tokens (--max-new-tokens)", self.max_new_tokens, 1)
        number("temperature (--temperature)", self.temperature, 0.0, MAX_TEMPERATURE)
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise UsageError(f"temperature (--temperature) must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; "
                             f"got {self.temperature!r}.", "Pass 0 for greedy decoding, or e.g. 0.7 to sample.")
        probability("top_p", self.top_p)
        optional_whole("seed (--seed)", self.seed, 0, MAX_SEED)
        whole("draft_tokens", self.draft_tokens, 0, MAX_DRAFT_TOKENS)
        return self


