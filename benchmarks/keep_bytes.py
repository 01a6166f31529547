"""Stored bytes per passage token for every codec x keep ratio, from one existing store (no model runs).

Reads the fused caches of an unpruned store (bf16 or float32: read back bit-exact), and
writes them again into a store per codec x keep ratio, keeping evenly spaced tokens with
the passage's first and last (what `encode --keep R --keep-by even` keeps; the
attention and norm methods keep as many tokens, so the byte counts differ only by
compression). Prints stored bytes over every passage token (manifest bytes, compressed,
as `store info` counts them), the ratio to raw bf16 KV, how many times smaller that is,
and the same ratio applied to Qwen3-0.6B's raw bf16 KV (28 layers x 8 KV heads x 128
head dim x 2 (K, V) x 2 bytes = 114,688 B/token), which assumes its caches compress as
these do.

    python benchmarks/keep_bytes.py STORE [--codecs bf16,int8,int4] [--keeps 1,0.75,0.5,0.25] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

QWEN3_06B_RAW = 28 * 8 * 128 * 2 * 2


def rewrite(source, url: str, codec: str, keep: float) -> dict:
    """`source`'s fused caches in a new store with `codec`, `keep` of each passage's tokens."""
    from dataclasses import replace

    from cachegraft_cli.encoding.keep import kept_count
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.identity import keep_entry

    identity = {k: v for k, v in source.identity.items() if k != "keep"}
    entry = keep_entry(keep, "even")
    identity = {**identity, "codec": codec, **({"keep": entry} if entry else {})}
    store = CacheStore.create(url, identity, source.prefix(), ("fused",))
    rows = source.rows()
    with store.writer({"tool": "benchmarks/keep_bytes.py"}) as writer:
        for row in rows:
            array = source.read([row.id])[0]
            n = len(array)
            if keep < 1:
                import numpy as np

                count = kept_count(n, keep)
                kept = sorted({int(round(x)) for x in np.linspace(0, n - 1, count)})
                writer.add(replace(row, positions=kept, span_tokens=n), {"fused": array[kept]})
            else:
                writer.add(row, {"fused": array})
    return CacheStore.open(url).info()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("store")
    p.add_argument("--codecs", default="bf16,int8,int4")
    p.add_argument("--keeps", default="1,0.75,0.5,0.25")
    p.add_argument("--out", default=None, help="where the stores are written (default: a temporary directory)")
    a = p.parse_args()
    from cachegraft_cli.store import CacheStore

    source = CacheStore.open(a.store)
    out = Path(a.out or tempfile.mkdtemp(prefix="keep-bytes-"))
    print(f"source {a.store}: {len(source)} passages, geometry {source.geometry}")
    print("| codec | keep | stored B / passage token | / raw bf16 | x smaller | Qwen3-0.6B B/token (computed) |")
    print("|---|---|---|---|---|---|")
    results = []
    for codec in a.codecs.split(","):
        for keep in (float(k) for k in a.keeps.split(",")):
            info = rewrite(source, str(out / f"{codec}-{keep:g}"), codec, keep)
            ratio = info["ratio_to_raw_bf16_full"]["fused"]
            per_token = info["bytes"]["per_kind"]["fused"] / info["passage_tokens"]
            results.append({"codec": codec, "keep": keep, "bytes_per_passage_token": per_token, "ratio": ratio,
                            "passage_tokens": info["passage_tokens"], "stored_tokens": info["tokens"]})
            print(f"| {codec} | {keep:g} | {per_token:,.0f} | {ratio:.3f} | {1 / ratio:.1f} | "
                  f"{ratio * QWEN3_06B_RAW:,.0f} |", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
