"""`encode --keep R`: which of a passage's tokens a pruned store keeps, chosen offline
(without the question) after fusion, so the kept tokens carry exactly the fused KV
they would have in a store that keeps every token.

Methods (`--keep-by`; `even` is the default: on 30 SQuAD questions at keep 0.5 it lost
no more F1 than `attention` and far less than `norm`, and it costs no scoring, see
docs/results.md):
- `attention`: the attention each token receives from the passage's later tokens at
  the receiver's last layers (H2O / SnapKV-style; `lm.attention`, measured in the
  encode forward itself);
- `norm`: the lowest key norms at those layers (low-norm keys draw the most attention);
- `even`: evenly spaced tokens.
The first and the last token of the passage block are always kept. Kept tokens
keep their original positions (the store records them per row).
"""

from __future__ import annotations

import math

KEEP_METHODS = ("attention", "norm", "even")
DEFAULT_KEEP_BY = "even"


def kept_count(tokens: int, ratio: float) -> int:
    """How many of `tokens` a ratio keeps: the ratio's share rounded up, at least the first and last token."""
    return min(tokens, max(min(tokens, 2), math.ceil(ratio * tokens - 1e-9)))


def kept_positions(kv, ratio: float, by: str) -> list[int]:
    """The positions (increasing) a `PassageKV` keeps; every position when the ratio keeps them all."""
    import numpy as np  # here, not at import: the CLI reads DEFAULT_KEEP_BY at start-up

    n = int(kv.own[0][0].shape[1])
    count = kept_count(n, ratio)
    if count >= n:
        return list(range(n))
    if by == "even":
        return sorted({int(round(x)) for x in np.linspace(0, n - 1, count)})
    scores = _scores(kv, by)[1 : n - 1]
    middle = np.argsort(-scores, kind="stable")[: count - 2] + 1  # ties: the earlier token
    return [0, *sorted(int(i) for i in middle), n - 1]


def _scores(kv, by: str):
    """Higher = more worth keeping (a numpy array)."""
    import numpy as np

    if by == "attention":
        if kv.attention is None:
            raise ValueError("attention scores were not computed: fuse with attention=True")
        return kv.attention.float().numpy()
    if by == "norm":
        from cachegraft_cli.fuser.fusion import SCORED_LAYERS

        norms = [kv.own[layer][0].float().norm(dim=-1).mean(dim=0) for layer in SCORED_LAYERS]
        return -np.mean([n.numpy() for n in norms], axis=0)
    raise ValueError(f"unknown keep method {by!r}")
