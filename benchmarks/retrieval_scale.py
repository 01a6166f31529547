"""Retrieval engines at 100k and 1M passages: build, append, open, query, memory, disk, recall.

Corpus of N rows: SQuAD v1.1 dev's 2,067 paragraphs first (so its questions
have their gold passage), then synthetic passages (`retrieval_corpus.py`:
Zipf-distributed words over SQuAD's vocabulary plus a made-up tail). Each
row has a text (lexical engines) and a vector (vector engines): the real
embedder's vectors for the SQuAD paragraphs and questions (computed once,
cached), Gaussian vectors with their mean and covariance for the rest.
Queries: SQuAD's questions (1,000 sampled, seed 0), so recall@1/3/5 against
the gold paragraph is measured among N - 2,067 distractors, and the vector
engines' top 5 are compared with exact search (`flat`).

Per engine, timed at the engine (tokenising and embedding are outside the timings):
- build: put all rows and commit (one segment for vector engines);
- append: put `--append` new rows and commit, into the built index and into an empty one;
- open, query p50/p99 at k=5, resident memory: in a fresh process per engine
  (RSS after opening and querying, minus the process before opening);
- bytes on disk (after the build; after the append).

    python benchmarks/retrieval_scale.py [--sizes 100000,1000000] [--engines tantivy,usearch,flat]
        [--append 10000] [--questions 1000] [--embedder DIR] [--work DIR]

Prints a table, then one JSON line. Timings are only meaningful on an idle machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import retrieval_corpus as rc

REPO = Path(__file__).resolve().parents[1]
SQUAD = str((REPO / ".." / "shared" / "data" / "qa" / "squad_v1.1_dev.json").resolve())
EMBEDDER = "/root/.cache/cachegraft-test-models/all-minilm-l6-v2"
WORK = Path(os.environ.get("CACHEGRAFT_BENCH_DIR", "/tmp/cachegraft-bench")) / "retrieval-scale"
CHUNK = 50_000  # rows generated, tokenised and put at a time (bounds memory)
K = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--engines", default="tantivy,usearch,flat")
    ap.add_argument("--append", type=int, default=10_000)
    ap.add_argument("--questions", type=int, default=1000)
    ap.add_argument("--squad", default=SQUAD)
    ap.add_argument("--embedder", default=EMBEDDER)
    ap.add_argument("--work", default=str(WORK))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="appends of each kind (medians reported)")
    ap.add_argument("--child", nargs=4, metavar=("ENGINE", "DIR", "QUERIES", "OUT"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data


class Data:
    """SQuAD paragraphs + questions (text, real vectors) and the synthetic rows' generators."""

    def __init__(self, args: argparse.Namespace):
        from cachegraft_cli.retrieval.index import _Tokenizer

        self.args = args
        self.tokenize = _Tokenizer(None)
        self.vocab = rc.Vocabulary(rc.squad_words(args.squad))
        self.paragraphs, self.questions, self.gold = _squad(args.squad, args.questions, args.seed)
        self.p_vectors, self.q_vectors = _squad_vectors(self, Path(args.work))

    def texts(self, lo: int, hi: int) -> list[str]:
        """Texts of rows [lo, hi)."""
        real = self.paragraphs[lo:min(hi, len(self.paragraphs))]
        start = max(lo, len(self.paragraphs))
        if hi <= start:
            return real
        return real + [d.text for d in rc.passages(self.vocab, hi - start, self.args.seed, start)]

    def terms(self, lo: int, hi: int) -> list[list[str]]:
        return [self.tokenize(t) for t in self.texts(lo, hi)]

    def vectors(self, lo: int, hi: int) -> np.ndarray:
        real = self.p_vectors[lo:min(hi, len(self.p_vectors))]
        start = max(lo, len(self.p_vectors))
        if hi <= start:
            return real
        synthetic = rc.gaussian_like(self.p_vectors, hi - start, self.args.seed * 1_000_003 + start)
        return np.concatenate([real, synthetic])

    def items(self, takes: str, lo: int, hi: int):
        return self.terms(lo, hi) if takes == "terms" else self.vectors(lo, hi)


def _squad(path: str, n: int, seed: int):
    from cachegraft_cli.corpus import read_corpus

    passages = list(read_corpus(path, format="json"))
    by_qa = {qa_id: i for i, p in enumerate(passages) for qa_id in p.metadata["qa_ids"]}
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    questions = [(qa["question"], by_qa[qa["id"]]) for a in data for p in a["paragraphs"] for qa in p["qas"]]
    if n and n < len(questions):
        questions = random.Random(seed).sample(questions, n)
    texts = [f"{p.title}\n{p.text}" if p.title else p.text for p in passages]
    return texts, [q for q, _ in questions], np.array([g for _, g in questions])


def _squad_vectors(data: Data, work: Path) -> tuple[np.ndarray, np.ndarray]:
    """The embedder's vectors of the paragraphs and questions, cached in the work dir."""
    cache = work / f"squad-vectors-{len(data.paragraphs)}-{len(data.questions)}-{data.args.seed}.npz"
    if cache.exists():
        saved = np.load(cache)
        return saved["paragraphs"], saved["questions"]
    from cachegraft_cli.retrieval.index import _Embedder

    log(f"embedding {len(data.paragraphs)} paragraphs and {len(data.questions)} questions (once)")
    embedder = _Embedder(data.args.embedder, progress=False)
    p, q = embedder.encode(data.paragraphs, query=False), embedder.encode(data.questions, query=True)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(cache, paragraphs=p, questions=q)
    return p, q


# ---------------------------------------------------------------- measuring


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def build(name: str, root: Path, data: Data, lo: int, hi: int) -> tuple[float, Any]:
    """Seconds spent in the engine (put + commit) for rows [lo, hi) of a new engine."""
    from cachegraft_cli.retrieval import engines

    shutil.rmtree(root, ignore_errors=True)
    engine = engines.create(name, root)
    spent = 0.0
    for start in range(lo, hi, CHUNK):
        items = data.items(engine.takes, start, min(hi, start + CHUNK))
        t0 = time.perf_counter()
        engine.put(list(range(start - lo, min(hi, start + CHUNK) - lo)), items)
        spent += time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.commit()
    return spent + time.perf_counter() - t0, engine


def append(engine, data: Data, lo: int, hi: int) -> float:
    items = data.items(engine.takes, lo, hi)
    first = engine.rows
    t0 = time.perf_counter()
    engine.put(list(range(first, first + hi - lo)), items)
    engine.commit()
    return time.perf_counter() - t0


def appends(name: str, engine, data: Data, n: int, args: argparse.Namespace, work: Path) -> dict:
    """The same new rows appended to the big engine and to an empty one, alternating;
    every repeat appends further rows to the big one (medians)."""
    from cachegraft_cli.retrieval import engines

    big, empty = [], []
    for repeat in range(args.repeats):
        lo = n + repeat * args.append
        for which in (("empty", "big") if repeat % 2 == 0 else ("big", "empty")):
            if which == "big":
                big.append(append(engine, data, lo, lo + args.append))
            else:
                root = work / f"{name}-empty"
                shutil.rmtree(root, ignore_errors=True)
                empty.append(append(engines.create(name, root), data, lo, lo + args.append))
                shutil.rmtree(root, ignore_errors=True)
    b, e = float(np.median(big)), float(np.median(empty))
    return {"append_big_s": b, "append_empty_s": e, "append_big/empty": b / max(e, 1e-9),
            "append_big_all_s": big, "append_empty_all_s": empty}


def measure_in_child(name: str, root: Path, params: dict, queries_file: Path, work: Path) -> dict:
    out = work / f"child-{name}.json"
    (root.parent / f"{root.name}.params.json").write_text(json.dumps(params))
    cmd = [sys.executable, __file__, "--child", name, str(root), str(queries_file), str(out)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def child(name: str, root: str, queries_file: str, out: str) -> int:
    """Open one engine in this fresh process, query it, report time and memory."""
    from cachegraft_cli.retrieval import engines

    cls = engines.engine_class(name)
    if cls.takes == "terms":
        import tantivy  # noqa: F401 - the library's own memory is not the index's

        queries = json.loads(Path(queries_file).read_text())
    else:
        import usearch.index  # noqa: F401

        queries = np.load(queries_file)
    params = json.loads(Path(f"{root.rstrip('/')}.params.json").read_text())
    rss0 = _rss()
    t0 = time.perf_counter()
    engine = engines.open_engine(name, Path(root), params)
    opened = time.perf_counter() - t0
    rss_open = _rss()
    for q in range(min(20, len(queries))):  # warm-up
        engine.search(queries[q:q + 1], K)
    times, rows = [], []
    for q in range(len(queries)):
        t0 = time.perf_counter()
        (found, _), = engine.search(queries[q:q + 1], K)
        times.append(time.perf_counter() - t0)
        rows.append(found.tolist() + [-1] * (K - len(found)))
    times.sort()
    Path(out).write_text(json.dumps({
        "open_s": opened, "p50_ms": 1e3 * times[len(times) // 2], "p99_ms": 1e3 * times[int(0.99 * (len(times) - 1))],
        "rss_open_mib": (rss_open - rss0) / 2**20, "rss_queried_mib": (_rss() - rss0) / 2**20,
        "rss_total_mib": _rss() / 2**20, "rows": rows}))
    return 0


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def recall(rows: list[list[int]], gold: np.ndarray) -> dict[str, float]:
    return {f"recall@{k}": round(float(np.mean([g in r[:k] for r, g in zip(rows, gold)])), 3) for k in (1, 3, 5)}


def overlap(rows: list[list[int]], exact: list[list[int]]) -> float:
    return round(float(np.mean([len(set(a) & set(b) - {-1}) / K for a, b in zip(rows, exact)])), 4)


# ---------------------------------------------------------------- one size


def run_size(n: int, names: list[str], data: Data, args: argparse.Namespace) -> dict[str, dict]:
    from cachegraft_cli.retrieval import engines

    work = Path(args.work) / f"n{n}"
    work.mkdir(parents=True, exist_ok=True)
    query_files = {"terms": work / "queries-terms.json", "vectors": work / "queries-vectors.npy"}
    query_files["terms"].write_text(json.dumps([data.tokenize(q) for q in data.questions]))
    np.save(query_files["vectors"], data.q_vectors)
    results: dict[str, dict] = {}
    for name in names:
        takes = engines.takes(name)
        log(f"n={n}: building {name}")
        root = work / name
        seconds, engine = build(name, root, data, 0, n)
        params = engine.commit()
        row: dict[str, Any] = {"build_s": seconds, "disk_bytes": disk_bytes(root)}
        row.update(measure_in_child(name, root, params, query_files[takes], work))
        log(f"n={n}: {name} appends")
        row.update(appends(name, engine, data, n, args, work))
        row["disk_bytes_after_append"] = disk_bytes(root)
        row.update(recall(row["rows"], data.gold))
        results[name] = row
        del engine
    exact = results.get("flat", {}).get("rows")
    for name, row in results.items():
        if exact is not None and engines.takes(name) == "vectors":
            row["top5_overlap_with_exact"] = overlap(row["rows"], exact)
    return results


COLUMNS = [("build_s", "build s", "{:.1f}"), ("append_big_s", "append big s", "{:.3f}"),
           ("append_empty_s", "append empty s", "{:.3f}"), ("append_big/empty", "big/empty", "{:.2f}"),
           ("open_s", "open s", "{:.4f}"), ("p50_ms", "p50 ms", "{:.2f}"), ("p99_ms", "p99 ms", "{:.2f}"),
           ("rss_queried_mib", "RSS MiB", "{:.0f}"), ("disk_bytes", "disk MiB", "{}"),
           ("recall@1", "R@1", "{:.3f}"), ("recall@3", "R@3", "{:.3f}"), ("recall@5", "R@5", "{:.3f}"),
           ("top5_overlap_with_exact", "top5=exact", "{:.4f}")]


def print_table(all_results: dict[int, dict[str, dict]]) -> None:
    print("size     engine   " + "".join(f"{title:>15}" for _, title, _ in COLUMNS))
    for n, results in all_results.items():
        for name, row in results.items():
            cells = []
            for key, _, fmt in COLUMNS:
                value = row.get(key)
                value = round(value / 2**20) if key == "disk_bytes" and value is not None else value
                cells.append(f"{fmt.format(value) if value is not None else '-':>15}")
            print(f"{n:<9}{name:<9}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(*args.child)
    t0 = time.perf_counter()
    load = os.getloadavg()
    data = Data(args)
    names = args.engines.split(",")
    all_results = {}
    for n in (int(s) for s in args.sizes.split(",")):
        all_results[n] = run_size(n, names, data, args)
    print_table(all_results)
    for results in all_results.values():
        for row in results.values():
            row.pop("rows", None)
    print(json.dumps({"sizes": list(all_results), "questions": len(data.questions), "append": args.append,
                      "loadavg_start": [round(x, 2) for x in load],
                      "loadavg_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
                      "total_s": round(time.perf_counter() - t0, 1), "results": all_results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
