"""Held-out answer NLL of several fusers on the same questions and the same
ask-time template (prefix + fused passage + question), for comparing the
receiver's own cache (closed), an adapter, and fusers with a sharer."""

from __future__ import annotations

import random

from cachegraft_cli.training import objectives
from cachegraft_cli.training.data import read_file


def sample_questions(path: str, template, max_passage_tokens: int, passages: int, per_passage: int, seed: int):
    """A seeded sample of (passage ids, QA pairs) from a SQuAD file: reading only, never training."""
    p, qs = read_file(path)
    ids = {k: template.passage_ids(x.title, x.text) for k, x in p.items()}
    keys = sorted(k for k in {q.passage for q in qs} if len(ids[k]) <= max_passage_tokens)
    random.Random(seed).shuffle(keys)
    keys = keys[:passages]
    chosen = [q for k in keys for q in [q for q in qs if q.passage == k][:per_passage]]
    return {k: ids[k] for k in keys}, chosen


def items_for(template, ids: dict, questions, max_answer_tokens: int = 32):
    return objectives.qa_items(questions, template, {k: len(v) for k, v in ids.items()}, max_answer_tokens)


def compare(receiver, bank, prefix, items, fusers: dict, batch_size: int = 4) -> dict:
    """Mean answer NLL per token for each fuser (None = the receiver's own cache)."""
    from cachegraft_cli.training.validation import evaluate

    out = {}
    for name, fuser in fusers.items():
        zero = fuser is not None and fuser.spec.sharer_input == "zero"
        f = fuser.float() if fuser is not None else None
        out[name] = evaluate(receiver, f, bank, prefix, items, batch_size, zero)
    return out
