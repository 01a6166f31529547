"""Recall@k of the BM25 / dense / hybrid retrieval index on a SQuAD-format file.

Corpus = every paragraph of the file (ids as `cachegraft_cli.corpus` gives
them); questions = a seeded sample of its questions; a question's gold passage
is the paragraph it was asked about. Prints a table, then one JSON line.

    python benchmarks/retrieval_recall.py [SQUAD_JSON] [--limit 1000] [--seed 0]
        [--kinds bm25,dense,hybrid] [--embedder HUB_ID_OR_DIR] [--engines NAME,...]

`--engines` picks the engines (`cachegraft_cli.engines`; defaults: tantivy for
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
from cachegraft_cli.retrieval import DEFAULT_EMBEDDER, build_index

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
    summary = {"data": Path(args.data).name, "passages": len(passages), "questions": len(questions),
               "seed": args.seed, "embedder": args.embedder, "engines": engines, "total_s": round(time.perf_counter() - t0, 1),
               "results": results}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
