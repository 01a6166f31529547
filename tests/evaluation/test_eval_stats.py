import math

import pytest

from cachegraft_cli.evaluation.stats import (
    bootstrap_ci,
    cohen_kappa,
    holm,
    mcnemar_exact,
    paired_comparison,
    rank_auc,
    wins_ties_losses,
)


def test_mcnemar_known_value():
    # b=10, c=2: 2 * P(Bin(12, .5) <= 2) = 2 * 79 / 4096
    assert mcnemar_exact(10, 2) == pytest.approx(2 * 79 / 4096)
    assert round(mcnemar_exact(10, 2), 4) == 0.0386
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2)
    assert mcnemar_exact(0, 0) == 1.0


def test_bootstrap_ci_known_case():
    values = [1.0] * 50 + [0.0] * 50  # mean .5, se = .05 -> normal CI [.402, .598]
    low, high = bootstrap_ci(values, seed=1, samples=4000)
    assert low == pytest.approx(0.402, abs=0.02)
    assert high == pytest.approx(0.598, abs=0.02)
    assert bootstrap_ci(values, seed=1, samples=4000) == (low, high)  # seeded
    assert bootstrap_ci([1.0, 1.0], seed=0) == (1.0, 1.0)


def test_holm_known_vector():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_cohen_kappa_known():
    # 2x2 table: agree yes 20, agree no 15, a-yes/b-no 5, a-no/b-yes 10 -> kappa = 0.4
    a = [1] * 20 + [0] * 15 + [1] * 5 + [0] * 10
    b = [1] * 20 + [0] * 15 + [0] * 5 + [1] * 10
    assert cohen_kappa(a, b) == pytest.approx(0.4)
    assert cohen_kappa([1, 1], [1, 1]) == 1.0
    assert math.isnan(cohen_kappa([], []))


def test_paired_comparison():
    a = [1] * 10 + [0] * 2 + [1] * 5 + [0] * 3
    b = [0] * 10 + [1] * 2 + [1] * 5 + [0] * 3
    assert wins_ties_losses(a, b) == (10, 8, 2)
    result = paired_comparison(a, b, seed=3, samples=500)
    assert (result.n, result.wins, result.ties, result.losses) == (20, 10, 8, 2)
    assert result.mean_diff == pytest.approx(0.4)
    assert result.ci_low < 0.4 < result.ci_high
    assert result.p_value == pytest.approx(0.0386, abs=1e-4)
    with pytest.raises(ValueError):
        wins_ties_losses([1], [1, 0])


def test_rank_auc_known():
    # positives 0.9, 0.4; negatives 0.5, 0.1: pairs won 3 of 4
    assert rank_auc([0.9, 0.5, 0.4, 0.1], [1, 0, 1, 0]) == pytest.approx(0.75)
    assert rank_auc([0.3, 0.3], [1, 0]) == pytest.approx(0.5)  # a tie counts half
    assert math.isnan(rank_auc([0.3, 0.2], [1, 1]))
