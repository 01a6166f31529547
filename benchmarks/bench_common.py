"""Shared helpers of the benchmark suite (not a benchmark itself).

Import this module before torch: it sets OMP_WAIT_POLICY=PASSIVE, because
idle OpenMP workers that spin steal cores from everyone on a small shared
machine and make timings depend on the neighbours.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as `cachegraft serve`: a short spin, then sleep

import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cachegraft_cli.config import pulled_models_dir as _pulled_models_dir
from cachegraft_cli.store.target import Target

REPO = Path(__file__).resolve().parents[1]
# The pulled offline pair (`cachegraft models pull offline`) unless $CACHEGRAFT_BENCH_MODELS names
# another folder holding both; the QA files of docs/data.md in $CACHEGRAFT_QA_DATA.
MODELS = Path(os.environ.get("CACHEGRAFT_BENCH_MODELS") or _pulled_models_dir())
RECEIVER = str(MODELS / "qwen2.5-coder-0.5b-instruct")
SHARER = str(MODELS / "qwen2.5-coder-1.5b-instruct")
QA_DATA = Path(os.environ.get("CACHEGRAFT_QA_DATA") or REPO / ".." / "shared" / "data" / "qa")
SQUAD = str((QA_DATA / "squad_v1.1_dev.json").resolve())
# None: the library's pick (bf16 only on CPUs with AVX512-BF16/AMX, else float32; bf16
# emulated on AVX2 is many times slower). CACHEGRAFT_BENCH_DTYPE=bfloat16 forces it.
DTYPE = os.environ.get("CACHEGRAFT_BENCH_DTYPE") or None
# The real-pair store ttft.py, ask_memory.py and batch_throughput.py share: 20 SQuAD paragraphs (k=5
# retrieves ~700 tokens, as the text systems read them; ~100 questions). Encoded with the
# closed fuser (the receiver's own caches): what these benchmarks time - retrieval,
# reading and assembling caches, the question's prefill, decoding - reads caches of the
# same geometry and codec whatever made them, and a random open fuser would add ~3 min of
# sharer passes on a 2-core CPU for nothing.
REAL_PASSAGES = 20
REAL_FUSER = "closed"
WORK_DIR = Path(os.environ.get("CACHEGRAFT_BENCH_DIR", "/tmp/cachegraft-bench"))


# ---------------------------------------------------------------- machine


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def machine() -> dict:
    """What the figures were measured on (load matters on a shared machine)."""
    import torch

    return {"cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data


@dataclass
class Question:
    question: str
    answers: list[str]
    gold: str


def squad_sample(n_questions: int, seed: int, path: str = SQUAD, min_passages: int = 0):
    """(passages, questions): seeded paragraphs with all their questions until n_questions are
    collected (at least `min_passages` paragraphs). Passages are `corpus.Passage`s with the ids
    the evaluation uses, so a question's gold passage is in the corpus."""
    from cachegraft_cli.corpus import Passage
    from cachegraft_cli.evaluation.datasets import read_squad

    questions, passages = read_squad(path)
    by_pid: dict[str, list] = {}
    for q in questions:
        by_pid.setdefault(q.gold_ids[0], []).append(q)
    order = [p for p in passages if p.id in by_pid]
    random.Random(seed).shuffle(order)
    chosen, qs = [], []
    for p in order:
        if len(qs) >= n_questions and len(chosen) >= min_passages:
            break
        chosen.append(Passage(p.id, p.title, p.text))
        qs += [Question(q.question, q.answers, p.id) for q in by_pid[p.id]]
    return chosen, qs[:n_questions]


# ---------------------------------------------------------------- models and stores


def random_fuser_dir(receiver, sharer, seed: int = 0) -> str:
    """A random-initialised fuser with open gates, saved once (fixed path and seed, so the
    store identity stays the same between runs and stores are reused)."""
    import torch

    from cachegraft_cli.fuser.checkpoint import OWN_WEIGHTS, save_own
    from cachegraft_cli.fuser.fuser import Fuser

    path = WORK_DIR / f"fuser-random-open-{seed}"
    if not (path / OWN_WEIGHTS).exists():
        torch.manual_seed(seed)
        fuser = Fuser.create(receiver.spec, sharer.spec, receiver.geometry, sharer.geometry)
        fuser.set_gates(1.0)
        save_own(fuser.eval(), path)
    return str(path)


def session_for(fuser: str = "random", seed: int = 0):
    """A ModelSession over the offline pair; fuser `random` (open gates), `closed`, or a dir."""
    from cachegraft_cli.lm.models import load_causal_lm
    from cachegraft_cli.session import ModelChoice, ModelSession

    if fuser == "random":
        receiver = load_causal_lm(RECEIVER, device="cpu", dtype=DTYPE)
        sharer = load_causal_lm(SHARER, device="cpu", dtype=DTYPE)
        fuser = random_fuser_dir(receiver, sharer, seed)
        session = ModelSession(ModelChoice(RECEIVER, SHARER, fuser, device="cpu", dtype=DTYPE))
        session.__dict__.update(receiver=receiver, sharer=sharer)  # reuse the loaded models (cached_property slots)
        return session
    return ModelSession(ModelChoice(RECEIVER, SHARER, fuser, device="cpu", dtype=DTYPE))


def ensure_store(url: str, passages, session, codec: str = "bf16", batch_size: int = 4) -> dict:
    """Encode (idempotent: reuses what is stored) and index (BM25) the passages."""
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.errors import StoreMismatchError
    from cachegraft_cli.retrieval.stored import build_store_index

    t0 = time.perf_counter()
    options = EncodeOptions(codec=codec, batch_size=batch_size)
    try:
        summary = encode_corpus(passages, Target.open(url), session, options)
    except StoreMismatchError as exc:  # made by other models/settings (e.g. an older CacheGraft): ours to rebuild
        if not Path(url).resolve().is_relative_to(WORK_DIR.resolve()):
            raise
        log(f"store {url} no longer matches ({exc}); rebuilding it")
        shutil.rmtree(url)
        summary = encode_corpus(passages, Target.open(url), session, options)
    build_store_index(url, "bm25")
    log(f"store {url}: added {summary.added}, skipped {summary.skipped_existing}, {time.perf_counter() - t0:.1f}s")
    return summary.as_dict()


def real_store_url(n_passages: int, seed: int = 0, fuser: str = REAL_FUSER) -> str:
    return str(WORK_DIR / f"real-{fuser}-{DTYPE or 'auto'}-s{seed}-n{n_passages}")


def real_data(n_passages: int, seed: int = 0):
    """(passages, questions about them) of the shared real-pair store."""
    passages, questions = squad_sample(10**9, seed)
    passages = passages[:n_passages]
    keep = {p.id for p in passages}
    return passages, [q for q in questions if q.gold in keep]


def real_store(n_passages: int, seed: int = 0, fuser: str = REAL_FUSER):
    """(store url, session, passages, questions): the real-pair store ttft.py, ask_memory.py and the batch
    benchmark share; built once under WORK_DIR and reused by later runs."""
    passages, questions = real_data(n_passages, seed)
    session = session_for(fuser, seed)
    url = real_store_url(n_passages, seed, fuser)
    ensure_store(url, passages, session)
    return url, session, passages, questions


def store_data(url: str, seed: int = 0):
    """(passages, SQuAD questions about them) of an existing store of SQuAD paragraphs."""
    from cachegraft_cli.store import CacheStore

    ids = set(CacheStore.open(url).ids())
    passages, questions = squad_sample(10**9, seed)
    return [p for p in passages if p.id in ids], [q for q in questions if q.gold in ids]


def stored_bytes(store, ids: list[str], kind: str = "fused") -> float:
    """Stored (compressed) bytes of passages: their tokens times their segment's bytes per token."""
    total = 0.0
    seg_bpt = {e["name"]: e["bytes"][kind] / e["tokens"] for e in store.segments}
    for row in store.get_rows(ids):
        total += row.tokens * seg_bpt[row.segment]
    return total


# ---------------------------------------------------------------- reporting


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def rotated(items: list, shift: int) -> list:
    """`items` starting at `shift` (mod len): the order conditions run in, repeat by repeat."""
    s = shift % len(items)
    return items[s:] + items[:s]


def verdict(value: float, limit: float, at_most: bool = True) -> str:
    ok = value <= limit if at_most else value >= limit
    rel = value / limit if limit else float("nan")
    return f"{'MET' if ok else 'MISSED'} ({value:.3g} vs {'<=' if at_most else '>='} {limit:g}; {rel:.2f}x of target)"


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"== {title} ==")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def _fmt(c) -> str:
    if isinstance(c, float):
        return f"{c:.4g}"
    return str(c)


def emit(figures: dict) -> None:
    """The final JSON line every benchmark prints."""
    print(json.dumps(figures, default=lambda o: round(o, 6) if isinstance(o, float) else str(o)), flush=True)
