"""Validation: mean NLL per scored token of items, with a fuser or the receiver's own cache.
Used by the loop, the outputs (weak-gate check) and the held-out tables."""

from __future__ import annotations

import torch

from cachegraft_cli.training import objectives


@torch.no_grad()
def evaluate(receiver, fuser, bank, prefix, items, batch_size: int, zero_sharer: bool) -> float:
    """Mean NLL per scored token (fuser None = the receiver's own cache)."""
    if not items:
        return float("nan")
    if fuser is not None:
        fuser.eval()
    total, count = 0.0, 0
    ordered = sorted(items, key=lambda i: i.past_tokens)
    for start in range(0, len(ordered), batch_size):
        loss, n = objectives.batch_nll(receiver, fuser, bank, prefix, ordered[start : start + batch_size], zero_sharer)
        total, count = total + float(loss), count + n
    return total / max(count, 1)
