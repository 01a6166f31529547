"""Encode throughput with and without the store writes, side by side.

Same passages, same batches, alternating: (a) fuse only, (b) fuse + convert +
write to a store (commit at the end). Also reports stored bytes per token.

    python benchmarks/encode_store.py --n 32 --batch-size 8 [--fuser DIR|random|closed]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2-thread torch spins badly beside other processes

import argparse
import json
import tempfile
import time
from pathlib import Path

from cachegraft_cli.config import pulled_models_dir

MODELS = Path(os.environ.get("CACHEGRAFT_BENCH_MODELS") or pulled_models_dir())  # `cachegraft models pull offline`
SQUAD = Path(os.environ.get("CACHEGRAFT_QA_DATA") or Path(__file__).resolve().parents[2] / "shared/data/qa") \
    / "squad_v1.1_dev.json"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receiver",
                   default=os.environ.get("CACHEGRAFT_TEST_RECEIVER", str(MODELS / "qwen2.5-coder-0.5b-instruct")))
    p.add_argument("--sharer",
                   default=os.environ.get("CACHEGRAFT_TEST_SHARER", str(MODELS / "qwen2.5-coder-1.5b-instruct")))
    p.add_argument("--fuser", default="random", help="fuser dir, 'random' (gates open) or 'closed'")
    p.add_argument("--squad", default=str(SQUAD))
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--codec", default="bf16")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def squad_passages(path: str, n: int):
    from cachegraft_cli.corpus import read_corpus

    out = []
    for p in read_corpus(path):
        out.append(p)
        if len(out) == n:
            return out
    return out


def random_fuser_dir(session) -> str:
    from cachegraft_cli.fuser.checkpoint import save_own
    from cachegraft_cli.fuser.fuser import Fuser

    r, s = session.receiver, session.sharer
    fuser = Fuser.create(r.spec, s.spec, r.geometry, s.geometry)
    fuser.set_gates(1.0)
    path = tempfile.mkdtemp(prefix="random-fuser-")
    save_own(fuser, path)
    return path


def build_session(args):
    from cachegraft_cli.session import ModelChoice, ModelSession

    fuser = None if args.fuser == "random" else args.fuser
    session = ModelSession(ModelChoice(args.receiver, args.sharer, fuser or "closed", device="cpu"))
    if args.fuser == "random":
        session = ModelSession(ModelChoice(args.receiver, args.sharer, random_fuser_dir(session), device="cpu"))
    return session


def run(args) -> dict:
    import torch

    from cachegraft_cli.encoding.plan import split_passage
    from cachegraft_cli.lm import kvcache

    torch.set_num_threads(args.threads)
    session = build_session(args)
    chunks = [c for p in squad_passages(args.squad, args.n) for c in split_passage(p, session.template, 512)]
    batches = [chunks[i : i + args.batch_size] for i in range(0, len(chunks), args.batch_size)]
    store = session.open_or_create_store(tempfile.mkdtemp(prefix="enc-store-") + "/s", args.codec, False)
    engine = session.fusion()
    engine.fuse([batches[0][0].ids])  # warm-up
    times = {"fuse_only": 0.0, "fuse_and_write": 0.0}
    with store.writer({"tool": "benchmark"}) as writer:
        for batch in batches:
            for cond in ("fuse_only", "fuse_and_write"):
                t = time.perf_counter()
                kvs = engine.fuse([c.ids for c in batch])
                if cond == "fuse_and_write":
                    for chunk, kv in zip(batch, kvs):
                        writer.add(chunk.row(), {"fused": kvcache.to_token_major(kv.fused)})
                times[cond] += time.perf_counter() - t
        t = time.perf_counter()
        entry = writer.commit()
        times["fuse_and_write"] += time.perf_counter() - t
    tokens = sum(len(c.ids) for c in chunks)
    return {
        "passages": len(chunks), "tokens": tokens, "batch_size": args.batch_size, "fuser": args.fuser,
        "dtype": str(session.receiver.dtype), "codec": args.codec,
        "tok_per_s_fuse_only": round(tokens / times["fuse_only"], 1),
        "tok_per_s_with_store": round(tokens / times["fuse_and_write"], 1),
        "write_overhead": round(times["fuse_and_write"] / times["fuse_only"], 3),
        "stored_bytes_per_token": round(sum(entry["bytes"].values()) / tokens, 1),
        "load_avg": os.getloadavg()[0],
    }


def main() -> None:
    figures = run(parse_args())
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
