"""What kind each answer is: right, or how it went wrong.

EM and F1 say how much an answer is worth, not why a wrong one is wrong. Over long free-form
passages the failures differ in cause and in cure: an answer copied from another retrieved
passage points at retrieval or at how independently encoded passages are assembled; a wrong span
of the right passage at reading; a right answer cut short or run long at the answer's style. So
`evaluate` labels every answer with one kind (`answer_kind`) and reports their shares per system
and k.

Where an answer's words occur is worked out when it is recorded (`answer_source`: the answer,
normalised as EM normalises it, looked up whole-word in the normalised retrieved passages), so the
summary needs the records only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from cachegraft_cli.evaluation.metrics import normalize_answer

RIGHT, EMPTY = "right", "empty"
CUT_SHORT, TOO_LONG, PARTLY = "cut short", "too long", "partly right"
WRONG_SPAN, OTHER_PASSAGE, IN_PASSAGES = "wrong span", "other passage", "in passages"
NOT_IN_PASSAGES, UNLOCATED = "not in passages", "wrong, not located"
# report order: right first, then the partial answers, then the wrong ones by where they came from
KINDS = (RIGHT, CUT_SHORT, TOO_LONG, PARTLY, WRONG_SPAN, OTHER_PASSAGE, IN_PASSAGES, NOT_IN_PASSAGES, UNLOCATED,
         EMPTY)

# where an answer's words occur among the retrieved passages
GOLD, OTHER, RETRIEVED, NONE = "gold", "other", "retrieved", "none"


def answer_source(answer: str, retrieved: Sequence[str], gold_ids: Sequence[str],
                  text_of: Callable[[str], str | None]) -> str | None:
    """`gold` when the normalised answer occurs in a retrieved gold passage, `other` when only in
    other retrieved passages, `none` when in no retrieved passage; without gold ids, `retrieved`
    or `none`. None for an empty answer. `text_of(id)` gives a passage's normalised text (None
    when unknown)."""
    words = normalize_answer(answer)
    if not words:
        return None
    hits = [pid for pid in retrieved if _contains(text_of(pid), words)]
    if not hits:
        return NONE
    if not gold_ids:
        return RETRIEVED
    return GOLD if set(hits) & set(gold_ids) else OTHER


def _contains(text: str | None, words: str) -> bool:
    return text is not None and f" {words} " in f" {text} "


def answer_kind(record: dict) -> str:
    """One of `KINDS` for an answer record (`answer`, `golds`, `em`, `f1`, and `source` as
    `answer_source` gives it). A question answered without passages (k = 0) has source `none`."""
    if record["em"] >= 1.0:
        return RIGHT
    answer = normalize_answer(record["answer"]).split()
    if not answer:
        return EMPTY
    if record["f1"] > 0:
        return _partial_kind(answer, [normalize_answer(g).split() for g in record["golds"]])
    # a record written before answers were located has no `source` (a resumed run adds it)
    return {GOLD: WRONG_SPAN, OTHER: OTHER_PASSAGE, RETRIEVED: IN_PASSAGES, NONE: NOT_IN_PASSAGES}.get(
        record.get("source") or "", UNLOCATED)


def _partial_kind(answer: list[str], golds: list[list[str]]) -> str:
    """An answer sharing words with a gold one: its words all within a gold answer's (cut short),
    a gold answer's words all within it (too long), or neither."""
    mine = Counter(answer)
    if any(not mine - Counter(gold) for gold in golds if gold):
        return CUT_SHORT
    if any(not Counter(gold) - mine for gold in golds if gold):
        return TOO_LONG
    return PARTLY


def kind_shares(records: Sequence[dict]) -> dict[str, float]:
    """The share of `records` of each kind (every kind in `KINDS`, zeros included)."""
    counts = Counter(answer_kind(r) for r in records)
    return {kind: counts[kind] / len(records) if records else 0.0 for kind in KINDS}


class PassageWords:
    """`text_of` for `answer_source`: each passage's normalised text by id, normalised on first
    use (a full corpus holds far more passages than a run retrieves)."""

    def __init__(self, texts: dict[str, str]):
        self._raw: dict[str, str] = texts
        self._done: dict[str, str | None] = {}

    def __call__(self, pid: str) -> str | None:
        if pid not in self._done:
            raw = self._raw.get(pid)
            self._done[pid] = None if raw is None else normalize_answer(raw)
        return self._done[pid]
