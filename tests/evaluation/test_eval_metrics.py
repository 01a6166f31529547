from cachegraft_cli.evaluation.metrics import aggregate, exact_match, f1_score, mean, normalize_answer, recall_at_k


def test_normalize_answer():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert normalize_answer("an apple, a pear") == "apple pear"


def test_exact_match_any_gold():
    assert exact_match("Denver Broncos.", ["the Denver Broncos", "Broncos"]) == 1.0
    assert exact_match("Broncos of Denver", ["Denver Broncos"]) == 0.0
    assert exact_match("x", []) == 0.0


def test_f1_known_values():
    # pred tokens: denver broncos won ; gold: denver broncos -> P=2/3, R=1
    assert abs(f1_score("Denver Broncos won", ["Denver Broncos"]) - 0.8) < 1e-12
    assert f1_score("Carolina", ["Denver Broncos"]) == 0.0
    # best over golds
    assert f1_score("Broncos", ["Denver Broncos", "Broncos"]) == 1.0
    assert abs(f1_score("Broncos", ["Denver Broncos"]) - 2 / 3) < 1e-12
    assert f1_score("the", ["a"]) == 1.0  # both normalise to empty


def test_recall_at_k():
    assert recall_at_k(["a", "b", "c"], ["c"], 3) == 1.0
    assert recall_at_k(["a", "b", "c"], ["c"], 2) == 0.0
    assert recall_at_k(["a"], [], 1) is None


def test_aggregate_and_mean():
    rows = [{"s": "x", "em": 1.0, "r": None}, {"s": "x", "em": 0.0, "r": 1.0}, {"s": "y", "em": 1.0, "r": None}]
    agg = aggregate(rows, ["s"], ["em", "r"])
    assert agg[("x",)] == {"n": 2, "em": 0.5, "r": 1.0}
    assert agg[("y",)]["r"] is None
    assert mean([]) is None
