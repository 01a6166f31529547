"""Recall@k of the BM25 / dense / hybrid retrieval index on a SQuAD-format file.

Corpus = every paragraph of the file (ids as `cachegraft_cli.corpus` gives
them); questions = a seeded sample of its questions; a question's gold passage
is the paragraph it was asked about. Prints a table, then one JSON line.

    python benchmarks/retrieval_recall.py [SQUAD_JSON] [--limit 1000] [--seed 0]
        [--kinds bm25,dense,hybrid] [--embedder HUB_ID_OR_DIR] [--engines NAME,...] [--reference]

`--reference` also ranks with bm25s' Lucene BM25 (k1 1.5, b 0.75, exact
lengths) over the same tokens: what the hand-written BM25 before engines
scored (its tests checked it equal to bm25s), and reports how often the
BM25 engine's top-k lists equal it.

`--engines` picks the engines (`cachegraft_cli.retrieval.engines`; defaults: tantivy for
BM25, usearch for vectors), e.g. `--kinds dense --engines flat` for exact search.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from cachegraft_cli.corpus import read_corpus
from cachegraft_cli.retrieval.index import DEFAULT_EMBEDDER, build_index

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / ".." / "shared" / "data" / "qa" / "squad_v1.1_dev.json"
KS = (1, 3, 5, 10)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", default=str(DEFAULT_DATA.resolve()))
    ap.add_argument("--limit", type=int, default=1000, help="questions sampled (0 = all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="bm25,dense,hybrid")
    ap.add_argument("--embedder", default=os.environ.get("CACHEGRAFT_TEST_EMBEDDER") or DEFAULT_EMBEDDER)
    ap.add_argument("--engines", default="", help="comma-separated engine names (default: the defaults)")
    ap.add_argument("--reference", action="store_true", help="compare BM25 top-k with bm25s' Lucene scores")
    return ap.parse_args(argv)


def load_questions(path: str, passages: list) -> list[tuple[str, str]]:
    """(question, gold passage id) for every question in the file."""
    by_qa = {qa_id: p.id for p in passages for qa_id in p.metadata["qa_ids"]}
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    return [(qa["question"], by_qa[qa["id"]])
            for article in data for para in article["paragraphs"] for qa in para["qas"]]


def recall(index, questions: list[tuple[str, str]]) -> dict[str, float]:
    hits = index.search_many([q for q, _ in questions], k=max(KS))
    ranked = [[h.id for h in hs] for hs in hits]
    return {f"recall@{k}": sum(gold in ids[:k] for ids, (_, gold) in zip(ranked, questions)) / len(questions)
            for k in KS}


def run_all(kinds: list[str], passages: list, questions: list, embedder: str,
            engines: list[str] | None = None) -> dict[str, dict]:
    """One index with every part needed (embedding once), searched as each kind."""
    built = "bm25" if kinds == ["bm25"] else "dense" if "bm25" not in kinds and "hybrid" not in kinds else "hybrid"
    t0 = time.perf_counter()
    index = build_index(passages, built, embedder=embedder, engines=engines)
    print(f"built {built} index ({index.engines}) in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    results = {}
    for kind in kinds:
        t1 = time.perf_counter()
        results[kind] = {**recall(index.view(kind), questions), "search_s": round(time.perf_counter() - t1, 2)}
    return results


def reference_rankings(passages: list, questions: list, depth: int = max(KS), k1: float = 1.5) -> list[list[str]]:
    """Top ids per question by bm25s' Lucene BM25 over the index's own tokens (ties: lower row first)."""
    import bm25s
    import numpy as np

    from cachegraft_cli.retrieval.index import _doc_text, _Tokenizer

    tokenize = _Tokenizer(None)
    vocab: dict[str, int] = {}
    docs = [[vocab.setdefault(t, len(vocab)) for t in tokenize(_doc_text(p))] for p in passages]
    model = bm25s.BM25(k1=k1, b=0.75, method="lucene")
    model.index((docs, vocab), create_empty_token=False, show_progress=False)
    out = []
    for question, _ in questions:
        ids = [vocab[t] for t in tokenize(question) if t in vocab]
        scores = np.asarray(model.get_scores_from_ids(ids), np.float32) if ids else np.zeros(len(passages))
        rows = np.flatnonzero(scores > 0)
        rows = rows[np.lexsort((rows, -scores[rows]))][:depth]
        out.append([passages[r].id for r in rows])
    return out


def agreement(got: list[list[str]], reference: list[list[str]], questions: list) -> dict[str, float]:
    out: dict[str, float] = {}
    for k in (1, 3, 5):
        out[f"same_top{k}_lists"] = sum(a[:k] == b[:k] for a, b in zip(got, reference))
        out[f"same_top{k}_sets"] = sum(set(a[:k]) == set(b[:k]) for a, b in zip(got, reference))
    for k in KS:
        hits = sum(gold in ids[:k] for ids, (_, gold) in zip(reference, questions))
        out[f"reference_recall@{k}"] = hits / len(questions)
    return out


def print_table(results: dict[str, dict]) -> None:
    cols = [f"recall@{k}" for k in KS] + ["search_s"]
    print(f"{'kind':<8}" + "".join(f"{c:>11}" for c in cols))
    for kind, row in results.items():
        print(f"{kind:<8}" + "".join(f"{row[c]:>11.3f}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    passages = list(read_corpus(args.data, format="json"))
    questions = load_questions(args.data, passages)
    if args.limit and args.limit < len(questions):
        questions = random.Random(args.seed).sample(questions, args.limit)
    print(f"{len(passages)} passages, {len(questions)} questions, embedder {args.embedder}", file=sys.stderr)
    t0 = time.perf_counter()
    engines = [e for e in args.engines.split(",") if e] or None
    results = run_all(args.kinds.split(","), passages, questions, args.embedder, engines)
    print_table(results)
    if args.reference and "bm25" in results:
        # k1 1.5 is the BM25 before engines; 1.2 is tantivy's own, with exact lengths: it splits
        # the difference into the k1 part and the one-byte length norms part
        reference, k12 = reference_rankings(passages, questions), reference_rankings(passages, questions, k1=1.2)
        lexical = build_index(passages, "bm25", engines=[e for e in engines or [] if e == "tantivy"] or None)
        got = [[h.id for h in hs] for hs in lexical.search_many([q for q, _ in questions], k=max(KS))]
        results["bm25"]["reference"] = agreement(got, reference, questions)
        results["bm25"]["vs_exact_k1_1.2"] = agreement(got, k12, questions)
        results["bm25"]["k1_1.2_vs_1.5"] = agreement(k12, reference, questions)
        print(json.dumps({key: results["bm25"][key] for key in ("reference", "vs_exact_k1_1.2", "k1_1.2_vs_1.5")}),
              file=sys.stderr)
    summary = {"data": Path(args.data).name, "passages": len(passages), "questions": len(questions),
               "seed": args.seed, "embedder": args.embedder, "engines": engines,
               "total_s": round(time.perf_counter() - t0, 1), "results": results}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
