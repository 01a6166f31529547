"""StoreWriter CPU cost per token, per codec and geometry, and the cache load `ask` does at k=5.

Random bf16-valued caches (log-normal channel scales, so the quantisers see outliers as in
real KV), written by one `StoreWriter` session into a fresh local store; one thread
(`torch.set_num_threads(1)`, blosc 1 thread), CPU time by `time.process_time`.
MB/s per core counts raw bf16 KV bytes (what the caches are before any codec).

Two figures per cell: `us/token`, everything the writer costs on this machine's CPU, and
`host us/token`, the same less the codec's `encode_tensor` (quantising), timed inside the same
run: what the CPU pays when the caches were fused on a GPU, where the writer quantises them.

    python benchmarks/writer_speed.py [--codecs bf16,int4] [--geometries qwen3-0.6b,offline]
        [--tokens 3072] [--input numpy|torch-bf16] [--read] [--json]
        [--receiver MODEL_DIR]   # bytes and error on that receiver's own KV of sample_data passages

Run it under another checkout (PYTHONPATH=OTHER python benchmarks/writer_speed.py) for
before/after figures: codecs that checkout lacks are skipped.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GEOMETRIES = {
    "qwen3-0.6b": {"layers": 28, "kv_heads": 8, "head_dim": 128},
    "offline": {"layers": 24, "kv_heads": 2, "head_dim": 64},  # Qwen2.5-Coder-0.5B, the offline receiver
}


def compressors() -> dict:
    """`encode --compressor`'s names and specs, plus Blosc lz4 for comparison (not an encode setting).
    A checkout from before `--compressor` (before/after runs) has only its default, as zstd."""
    from cachegraft_cli.store import layout

    known = getattr(layout, "COMPRESSORS", {"zstd": layout.DEFAULT_COMPRESSOR})
    return {**known, "lz4": {"name": "blosc", "cname": "lz4", "clevel": 5, "shuffle": "shuffle"}}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codecs", default="", help="comma list (default: every codec this checkout knows)")
    p.add_argument("--geometries", default="qwen3-0.6b,offline")
    p.add_argument("--tokens", type=int, default=3072, help="tokens written per measurement")
    p.add_argument("--passage-tokens", type=int, default=150)
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell (the median is printed)")
    p.add_argument("--input", choices=("numpy", "torch-bf16"), default="torch-bf16",
                   help="what add() gets: bf16 torch tensors (what encode hands it) or float32 numpy")
    p.add_argument("--compressor", choices=sorted(compressors()), default="zstd",
                   help="the store's compressor: zstd (Blosc zstd 1, the default), none, or lz4 (Blosc lz4 5)")
    p.add_argument("--read", action="store_true", help="also time CacheStore.read of 5 passages of 150 tokens")
    p.add_argument("--receiver", default="", help="model dir: also measure bytes and reconstruction error per "
                   "codec on this receiver's own KV of --corpus passages")
    p.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1] / "sample_data" / "corpus.jsonl"))
    p.add_argument("--passages", type=int, default=10)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def one_thread() -> None:
    import numcodecs.blosc
    import torch

    torch.set_num_threads(1)
    numcodecs.blosc.set_nthreads(1)


def identity(codec: str, geometry: dict) -> dict:
    return {"receiver": {"name": "bench/receiver"}, "sharer": {"name": "bench/sharer"}, "fuser": None,
            "template": {"name": "plain", "version": 1}, "prefix_token_ids": [], "position_scheme": "canonical",
            "dtype": "bfloat16", "codec": codec, "geometry": geometry}


def pool(geometry: dict, tokens: int, seed: int = 0) -> np.ndarray:
    """bf16-representable float32 `(tokens, layers, 2, heads, head_dim)`, per-channel log-normal scales."""
    import torch

    shape = (geometry["layers"], 2, geometry["kv_heads"], geometry["head_dim"])
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(shape, generator=g))
    x = torch.randn((tokens,) + shape, generator=g) * scale
    return x.to(torch.bfloat16).to(torch.float32).numpy()


def passages(data: np.ndarray, total: int, n: int, kind: str):
    import torch

    for i, start in enumerate(range(0, total, n)):
        size = min(n, total - start)
        off = (start * 7) % (len(data) - size)
        x = data[off: off + size]
        yield i, (torch.from_numpy(x).to(torch.bfloat16) if kind == "torch-bf16" else x)


class Timed:
    """Wraps a codec's `encode_tensor` (where the codec has one) and adds up its CPU time."""

    def __init__(self, codec):
        self.codec, self.seconds = codec, 0.0
        self.inner = getattr(codec, "encode_tensor", None)
        if self.inner is not None:
            codec.encode_tensor = self

    def __call__(self, x):
        t0 = time.process_time()
        try:
            return self.inner(x)
        finally:
            self.seconds += time.process_time() - t0


_FITTED: dict = {}


def codec_params(codec: str, geometry: dict, data: np.ndarray) -> dict | None:
    """The transform codec's calibration, fitted once per geometry on up to 1,500 tokens of `data`
    (as passages of 150; random caches have no structure to find, so its bytes here are not real KV's:
    see --receiver and benchmarks/codec_fidelity.py); None for the other codecs."""
    if codec != "tc":
        return None
    key = json.dumps(geometry, sort_keys=True)
    if key not in _FITTED:
        from cachegraft_cli.store import transform as tf

        t0 = time.perf_counter()
        starts = range(0, min(1500, len(data) - 149), 150)
        _FITTED[key] = tf.fit([data[i: i + 150] for i in starts], tf.FitOptions(), "writer_speed")
        print(f"# tc calibration for {geometry} fitted in {time.perf_counter() - t0:.1f}s "
              f"({len(_FITTED[key].to_bytes()):,} bytes)", file=sys.stderr)
    return {"calibration": _FITTED[key]}


def write_once(codec: str, geometry: dict, data: np.ndarray, args) -> tuple:
    """CPU seconds of one writer session (create not counted): add every passage, commit; and of
    the codec's quantising within it."""
    from cachegraft_cli.store import CacheStore, PassageRow

    shape = data.shape[1:]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        store = CacheStore.create(f"{tmp}/s", identity(codec, geometry), np.zeros((0,) + shape, np.float32),
                                  compressor=compressors()[args.compressor],
                                  codec_params=codec_params(codec, geometry, data))
        items = list(passages(data, args.tokens, args.passage_tokens, args.input))
        timed = Timed(store.codec)
        t0 = time.process_time()
        with store.writer() as w:
            for i, x in items:
                w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": x})
        cpu = time.process_time() - t0
        info = CacheStore.open(f"{tmp}/s").info()
    return cpu, info["bytes_per_token"]["fused"], info["nominal_bytes_per_token"], timed.seconds


def read_cell(codec: str, geometry: dict, data: np.ndarray, reps: int = 40) -> dict:
    """`ask`'s cache load at k=5: `CacheStore.read` of 5 random passages of 150 tokens, fresh handle each
    time (as a new `ask` opens the store), over 40 passages."""
    from cachegraft_cli.store import CacheStore, PassageRow

    shape = data.shape[1:]
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        store = CacheStore.create(f"{tmp}/s", identity(codec, geometry), np.zeros((0,) + shape, np.float32),
                                  codec_params=codec_params(codec, geometry, data))
        with store.writer() as w:
            for i in range(40):
                off = (i * 97) % (len(data) - 150)
                w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": data[off: off + 150]})
        walls, cpus = [], []
        for _ in range(reps):
            ids = [f"p{j}" for j in rng.choice(40, 5, replace=False)]
            s = CacheStore.open(f"{tmp}/s")
            t0, c0 = time.perf_counter(), time.process_time()
            s.read(ids)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    return {"read_ms_wall": 1e3 * statistics.median(walls), "read_ms_cpu": 1e3 * statistics.median(cpus)}


def real_kv(receiver: str, corpus: str, n: int) -> list[np.ndarray]:
    """The receiver's own KV of the first `n` passages (first 160 tokens each), token-major, bf16 values
    (the forward runs in float32: bf16 matmuls are slow on CPUs without AVX512-BF16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cachegraft_cli.lm import kvcache

    tok = AutoTokenizer.from_pretrained(receiver)
    model = AutoModelForCausalLM.from_pretrained(receiver, dtype=torch.float32).eval()
    texts = [json.loads(line)["text"] for line in Path(corpus).read_text().splitlines() if line.strip()][:n]
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids[:, :160]
            kv = kvcache.from_model_cache(model(ids, use_cache=True).past_key_values)
            out.append(kvcache.to_token_major([(k[0].to(torch.bfloat16), v[0].to(torch.bfloat16)) for k, v in kv]))
    return out


def error_rows(caches: list[np.ndarray], codecs: list[str]) -> list[dict]:
    """Per codec: stored bytes per token (one segment, as `store info` measures) and the relative RMS
    error of keys and values over all passages, read back from the store."""
    from cachegraft_cli.store import CacheStore, PassageRow, raw_bf16_bytes_per_token

    layers, _, heads, dim = caches[0].shape[1:]
    geometry = {"layers": int(layers), "kv_heads": int(heads), "head_dim": int(dim)}
    x = np.concatenate(caches)
    rows = []
    for codec in codecs:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            store = CacheStore.create(f"{tmp}/s", identity(codec, geometry), np.zeros((0,) + x.shape[1:], np.float32))
            with store.writer() as w:
                for i, c in enumerate(caches):
                    w.add(PassageRow(id=f"p{i}", content_hash=f"h{i}"), {"fused": c})
            again = CacheStore.open(f"{tmp}/s")
            y = np.concatenate(again.read([f"p{i}" for i in range(len(caches))]))
            info = again.info()
        err = {f"rel_rms_{n}": float(np.sqrt(((y[:, :, j] - x[:, :, j]) ** 2).sum() / (x[:, :, j] ** 2).sum()))
               for j, n in enumerate(("k", "v"))}
        raw = raw_bf16_bytes_per_token(geometry)
        rows.append({"codec": codec, "tokens": len(x), "bytes_per_token": info["bytes_per_token"]["fused"],
                     "nominal_bytes_per_token": info["nominal_bytes_per_token"],
                     "ratio_to_raw_bf16": info["bytes_per_token"]["fused"] / raw, **err})
    return rows


def main() -> None:
    args = parse_args()
    one_thread()
    from cachegraft_cli.store import CODECS, raw_bf16_bytes_per_token

    wanted = [c for c in args.codecs.split(",") if c] or list(CODECS)
    if args.receiver:
        for row in error_rows(real_kv(args.receiver, args.corpus, args.passages),
                              [c for c in wanted if c in CODECS and c != "tc"]):  # tc: codec_fidelity.py
            print(json.dumps(row) if args.json else
                  f"real KV {row['codec']:8s} {row['bytes_per_token']:8.1f} B/token ({row['ratio_to_raw_bf16']:.3f}x "
                  f"raw, nominal {row['nominal_bytes_per_token']:.0f})  rel RMS error K {row['rel_rms_k']:.4f} "
                  f"V {row['rel_rms_v']:.4f}", flush=True)
    rows = []
    for gname in args.geometries.split(","):
        geometry = GEOMETRIES[gname]
        raw = raw_bf16_bytes_per_token(geometry)
        data = pool(geometry, 1024 if gname == "qwen3-0.6b" else 4096)
        for codec in wanted:
            if codec not in CODECS:
                print(f"# {codec}: not in this checkout, skipped", file=sys.stderr)
                continue
            runs = [write_once(codec, geometry, data, args) for _ in range(args.repeats)]
            cpu = statistics.median(r[0] for r in runs)
            us = 1e6 * cpu / args.tokens
            host = 1e6 * statistics.median(r[0] - r[3] for r in runs) / args.tokens
            row = {"geometry": gname, "codec": codec, "input": args.input, "compressor": args.compressor,
                   "tokens": args.tokens,
                   "us_per_token": us, "host_us_per_token": host, "quantise_us_per_token": us - host,
                   "mb_per_s_per_core": raw / us, "bytes_per_token": runs[0][1],
                   "nominal_bytes_per_token": runs[0][2], "ratio_to_raw_bf16": runs[0][1] / raw}
            if args.read:
                row.update(read_cell(codec, geometry, data))
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                extra = f"  read k=5 {row['read_ms_wall']:6.1f} ms wall {row['read_ms_cpu']:6.1f} ms cpu" \
                    if args.read else ""
                print(f"{gname:11s} {codec:8s} {us:8.1f} us/token (host {host:7.1f}) {raw / us:7.1f} MB/s/core  "
                      f"{row['bytes_per_token']:9.1f} B/token ({row['ratio_to_raw_bf16']:.3f}x raw){extra}",
                      flush=True)


if __name__ == "__main__":
    main()
