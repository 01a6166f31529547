"""Paired statistics for per-question 0/1 verdicts of two systems."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

ALPHA = 0.05


@dataclass(frozen=True)
class PairedResult:
    n: int
    wins: int  # A right, B wrong
    ties: int
    losses: int  # A wrong, B right
    mean_diff: float
    ci_low: float
    ci_high: float
    p_value: float

    def to_dict(self) -> dict:
        return asdict(self)


def wins_ties_losses(a: Sequence[float], b: Sequence[float]) -> tuple[int, int, int]:
    _check_paired(a, b)
    wins = sum(x > y for x, y in zip(a, b))
    losses = sum(x < y for x, y in zip(a, b))
    return wins, len(a) - wins - losses, losses


def _check_paired(a: Sequence, b: Sequence) -> None:
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")


def bootstrap_ci(values: Sequence[float], seed: int = 0, samples: int = 2000,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean (resampling items with replacement)."""
    import numpy as np

    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    chunk = max(1, 2_000_000 // data.size)  # bound memory of the index matrix
    means = np.concatenate([
        data[rng.integers(0, data.size, size=(min(chunk, samples - start), data.size))].mean(axis=1)
        for start in range(0, samples, chunk)
    ])
    tail = (1.0 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def mcnemar_exact(wins: int, losses: int) -> float:
    """Exact McNemar test = two-sided sign test on the discordant pairs."""
    if wins + losses == 0:
        return 1.0
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses, 0.5, alternative="two-sided").pvalue)


def paired_comparison(a: Sequence[float], b: Sequence[float], seed: int = 0,
                      samples: int = 2000) -> PairedResult:
    """Compare per-question verdicts of A and B (same questions, same order)."""
    wins, ties, losses = wins_ties_losses(a, b)
    diffs = [x - y for x, y in zip(a, b)]
    low, high = bootstrap_ci(diffs, seed, samples)
    mean_diff = sum(diffs) / len(diffs) if diffs else float("nan")
    return PairedResult(len(diffs), wins, ties, losses, mean_diff, low, high, mcnemar_exact(wins, losses))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input order."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def cohen_kappa(a: Sequence, b: Sequence) -> float:
    """Cohen's kappa of two raters' labels.

    When both raters give one and the same label throughout, kappa is 0/0;
    this returns 1.0 for that perfect agreement.
    """
    _check_paired(a, b)
    n = len(a)
    if n == 0:
        return float("nan")
    labels = set(a) | set(b)
    observed = sum(x == y for x, y in zip(a, b)) / n
    expected = sum((list(a).count(c) / n) * (list(b).count(c) / n) for c in labels)
    if expected == 1.0:
        return 1.0
    return (observed - expected) / (1.0 - expected)


def rank_auc(scores: Sequence[float], labels: Sequence[int]) -> float:
    """Area under the ROC curve of `scores` for binary `labels` (ties count half):
    the chance that a random positive outscores a random negative. NaN without both classes."""
    _check_paired(scores, labels)
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return float("nan")
    from scipy.stats import mannwhitneyu

    return float(mannwhitneyu(pos, neg).statistic) / (len(pos) * len(neg))
