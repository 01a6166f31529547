"""Stored bytes per token per codec, and the F1 cost of lossy codecs (real models).

Encodes the SQuAD paragraphs behind a seeded sample of questions once into a
float32 store (lossless whatever dtype the models run in; on CPUs without fast
bf16 they run in float32, so bf16 is lossy too), then writes the very same
fused caches (read back bit-exact) into bf16, int8 and int4 stores - what
`encode --codec ...` would store, without running the models again. Each store
gets its own BM25 index over the same passages, so retrieval is identical.

Reports stored bytes per token / raw bf16 bytes per token (manifest bytes,
compressed, as `store info` counts them) and, answering every question with
`graft` at k from each store (greedy), mean SQuAD F1 per codec and the change
vs float32 (lossless) in F1 points, with a paired 95% interval.

--fuser closed (default) makes graft answer from the receiver's own caches,
so the F1 change measures what the codec does to a real KV cache without
depending on any fuser (and without the sharer's cost). A trained fuser dir
(e.g. the shipped one's) measures it on fused caches; --fuser random is only
meaningful for the bytes figures (a random open fuser answers nonsense).

    python benchmarks/codec_quality.py [--questions 200] [--k 3] [--fuser closed|random|DIR] [--codecs bf16,int8,int4]
"""

from __future__ import annotations

import argparse
import math
import sys

import bench_common as bc

CODECS = ("float32", "bf16", "int8", "int4")  # float32 first: the lossless reference
TARGETS = {"int8": {"bytes_ratio": 0.52, "f1_drop_pts": 0.5}, "int4": {"bytes_ratio": 0.28, "f1_drop_pts": 1.0}}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fuser", default="closed")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--codecs", default=",".join(CODECS[1:]), help="lossy codecs to compare with float32")
    return ap.parse_args(argv)


def transcode(src_url: str, dst_url: str, codec: str, codec_params: dict | None = None) -> None:
    """Write the source store's fused caches (decoded, bit-exact for bf16) into a new `codec` store
    (`codec_params`: e.g. the tc codec's {"calibration": Calibration})."""
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store import CacheStore

    src = CacheStore.open(src_url)
    stale(dst_url, codec, src.geometry, codec_params)
    dst = CacheStore.create(dst_url, {**src.identity, "codec": codec}, src.prefix(), src.kinds,
                            codec_params=codec_params)
    todo = [r for r in src.rows() if r.id not in dst]
    if todo:
        with dst.writer({"tool": "benchmarks/codec_quality.py transcode", "from": src_url}) as w:
            for row in todo:
                w.add(row, {kind: src.read([row.id], kind=kind)[0] for kind in src.kinds})
    build_store_index(dst_url, "bm25")


def stale(url: str, codec: str, geometry: dict, codec_params: dict | None = None) -> None:
    """Remove a store made with other codec parameters (e.g. symmetric int4, before zero
    points): the codec parameters are not part of a store's identity, so create() would
    reuse it."""
    import shutil

    from cachegraft_cli.errors import StoreNotFoundError
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.codecs import get_codec

    try:
        old = CacheStore.open(url)
    except StoreNotFoundError:
        return
    if old.codec.params != get_codec(codec, geometry, codec_params).params:
        bc.log(f"{url}: codec parameters {old.codec.params} are not today's; rebuilding it")
        shutil.rmtree(url)


def bytes_per_token(url: str) -> dict:
    from cachegraft_cli.store import CacheStore, raw_bf16_bytes_per_token

    store = CacheStore.open(url)
    tokens = sum(s["tokens"] for s in store.segments)
    stored = sum(s["bytes"]["fused"] for s in store.segments)
    raw = raw_bf16_bytes_per_token(store.geometry)
    nominal = store.codec.nominal_bytes_per_token()
    return {"tokens": tokens, "bytes_per_token": stored / tokens, "raw_bf16": raw, "codec_params": store.codec.params,
            "ratio": stored / tokens / raw, "nominal_ratio": nominal / raw}


def answer_all(askers: dict, questions, k: int, max_new: int) -> dict[str, list[float]]:
    """F1 per question per codec; codecs take turns question by question."""
    from cachegraft_cli.answering.ask import AskOptions
    from cachegraft_cli.evaluation.metrics import f1_score
    from cachegraft_cli.lm.generation import GenerationOptions

    options = AskOptions("graft", k, generation=GenerationOptions(max_new_tokens=max_new))
    f1 = {c: [] for c in askers}
    for i, q in enumerate(questions):
        for codec in bc.rotated(list(askers), i):
            f1[codec].append(f1_score(askers[codec].ask(q.question, options)["answer"], q.answers))
        if (i + 1) % 20 == 0:
            bc.log(f"{i + 1}/{len(questions)} questions; mean F1 so far " +
                   ", ".join(f"{c}={100 * sum(v) / len(v):.1f}" for c, v in f1.items()))
    return f1


def paired_delta(base: list[float], other: list[float]) -> dict:
    """Mean change in F1 points with a normal-approximation 95% interval over questions."""
    d = [100 * (o - b) for b, o in zip(base, other)]
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1))
    half = 1.96 * sd / math.sqrt(len(d))
    return {"delta_pts": mean, "ci95": [mean - half, mean + half], "changed": sum(x != 0 for x in d)}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.answering.ask import Asker

    passages, questions = bc.squad_sample(args.questions, args.seed, min_passages=args.k)
    session = bc.session_for(args.fuser, args.seed)
    tag = "closed" if args.fuser == "closed" else "random" if args.fuser == "random" else "dir"
    codecs = ["float32"] + [c for c in args.codecs.split(",") if c and c != "float32"]
    urls = {c: str(bc.WORK_DIR / f"p3-{tag}-{bc.DTYPE or 'auto'}-s{args.seed}-n{len(passages)}-{c}") for c in codecs}
    bc.ensure_store(urls["float32"], passages, session, codec="float32")
    for codec in codecs[1:]:
        transcode(urls["float32"], urls[codec], codec)
    sizes = {c: bytes_per_token(u) for c, u in urls.items()}
    askers = {c: Asker(u, session=session) for c, u in urls.items()}
    for a in askers.values():
        a.warm("graft")
    start_machine = bc.machine()
    f1 = answer_all(askers, questions, args.k, args.max_new_tokens)
    mean_f1 = {c: 100 * sum(v) / len(v) for c, v in f1.items()}
    deltas = {c: paired_delta(f1["float32"], f1[c]) for c in codecs[1:]}
    rows = [[c, sizes[c]["bytes_per_token"], sizes[c]["ratio"], sizes[c]["nominal_ratio"], mean_f1[c],
             deltas[c]["delta_pts"] if c in deltas else 0.0,
             "%.2f..%.2f" % tuple(deltas[c]["ci95"]) if c in deltas else "-",
             deltas[c]["changed"] if c in deltas else "-"] for c in codecs]
    bc.print_table(f"Codec quality: {len(passages)} passages ({sizes['float32']['tokens']} tokens), "
                   f"{len(questions)} questions, "
                   f"graft k={args.k}, fuser {args.fuser}",
                   ["codec", "B/token", "ratio", "nominal", "F1", "dF1_pts", "95%CI", "q_changed"], rows)
    verdicts = {}
    for c, t in TARGETS.items():
        if c not in deltas:
            continue
        drop = -deltas[c]["delta_pts"]
        verdicts[c] = {"bytes": bc.verdict(sizes[c]["ratio"], t["bytes_ratio"]),
                       "f1": bc.verdict(drop, t["f1_drop_pts"])}
        print(f"{c}: bytes {verdicts[c]['bytes']}; F1 drop {verdicts[c]['f1']}")
    print(f"machine at start: {start_machine}; at end: loadavg {bc.machine()['loadavg']}")
    bc.emit({"bench": "codec_quality", "fuser": args.fuser, "k": args.k, "questions": len(questions),
             "passages": len(passages), "sizes": sizes, "mean_f1": mean_f1, "deltas": deltas,
             "targets": {c: t for c, t in TARGETS.items() if c in deltas},
             "machine_start": start_machine, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
