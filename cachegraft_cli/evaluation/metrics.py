"""SQuAD-normalised exact match and token F1, recall@k, aggregation."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower case, drop punctuation and articles, collapse whitespace (SQuAD v1.1)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _em_one(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _f1_one(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, golds: Sequence[str]) -> float:
    """1.0 when the prediction matches any gold answer after normalisation."""
    return max((_em_one(prediction, g) for g in golds), default=0.0)


def f1_score(prediction: str, golds: Sequence[str]) -> float:
    """Best token F1 over the gold answers."""
    return max((_f1_one(prediction, g) for g in golds), default=0.0)


def recall_at_k(retrieved_ids: Sequence[str], gold_ids: Iterable[str], k: int | None = None) -> float | None:
    """1.0 when any gold id is among the first k retrieved; None without gold ids."""
    gold = set(gold_ids)
    if not gold:
        return None
    top = retrieved_ids if k is None else retrieved_ids[:k]
    return float(any(pid in gold for pid in top))


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the non-None values; None when there are none."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def aggregate(records: Iterable[dict], keys: Sequence[str], fields: Sequence[str]) -> dict[tuple, dict]:
    """Group records by `keys` and average each of `fields` (None values skipped)."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        groups.setdefault(tuple(record[k] for k in keys), []).append(record)
    return {
        key: {"n": len(rows), **{f: mean(r.get(f) for r in rows) for f in fields}}
        for key, rows in groups.items()
    }
