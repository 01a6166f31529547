"""The transform codec's CPU per token, encode and decode, against int8's (one thread).

Two cases: the offline receiver's real fused caches (the first 20 passages of a float32 store,
e.g. one `codec_fidelity.py` made) with the calibration the offline fuser ships, through each
entropy stage (packed deflate bands, the default; the zstd bands of stores of 2026-12-04 to
2026-12-06; ANS, the first tc stores'); and the
Qwen3-0.6B geometry (28 layers x 8 KV heads x 128) on synthetic caches with structure (64
shared latent features per token plus noise), calibrated on 2,400 of them. `time.process_time`.

    python benchmarks/tc_speed.py --store FLOAT32_STORE [--compare CALIBRATION] [--no-qwen3]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time

import numpy as np

OFFLINE_FUSER = "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"


def timed(codec, caches: list) -> tuple[float, float, int, float]:
    """(encode, decode) CPU microseconds per token (decoding 5 passages at a time, as `ask` reads
    them; the best of 3), groups coded at coarser steps, and the code's bytes per token."""
    codec.encode(caches[0][:16])  # tables loaded, models built
    t = time.process_time()
    parts = [codec.encode(x) for x in caches]
    enc = time.process_time() - t
    reads = [(p, 0, len(x)) for p, x in zip(parts, caches)]
    dec = float("inf")
    for _ in range(3):
        t = time.process_time()
        for i in range(0, len(reads), 5):
            codec.decode_many(reads[i: i + 5])
        dec = min(dec, time.process_time() - t)
    n = sum(len(x) for x in caches)
    coded = "head" in parts[0]
    shifted = sum(int((p["head"][:, 2] > 0).sum()) for p in parts) if coded else 0
    code = sum(4 * int(p["head"][:, 0].sum()) for p in parts) / n if coded else float("nan")
    return 1e6 * enc / n, 1e6 * dec / n, shifted, code


CODECS = (("int8", {}), ("tc", {}), ("tc-zstd", {"entropy": "zstd", "level": 15}), ("tc-ans", {"entropy": "ans"}))


def row(label: str, name: str, figures: tuple, tokens: int) -> str:
    enc, dec, shifted, code = figures
    return (f"{label}  {name:6s} encode {enc:7.0f} us/token  decode {dec:7.0f} us/token  code {code:6.0f} B/token  "
            f"({tokens} tokens, {shifted} groups coded coarser)")


def synthetic(rng, mix: np.ndarray, tokens: int) -> np.ndarray:
    layers, _, rank, width = mix.shape
    latent = rng.normal(0, 1, (tokens, rank)).astype(np.float32)
    x = np.einsum("tr,lkrc->tlkc", latent, mix) + rng.normal(0, 0.3, (tokens, layers, 2, width)).astype(np.float32)
    return x.reshape(tokens, layers, 2, 8, width // 8)


def main() -> None:
    import torch

    from cachegraft_cli.encoding.calibration import load_file, shipped_file
    from cachegraft_cli.store import CacheStore, transform as tf
    from cachegraft_cli.store.codecs import get_codec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a float32 store of the offline pair's fused caches")
    ap.add_argument("--compare", default=None, help="another calibration file, timed after the shipped one (zstd)")
    ap.add_argument("--no-qwen3", action="store_true", help="skip the Qwen3-0.6B geometry")
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = CacheStore.open(args.store)
    caches = store.read(store.ids()[:20])
    cal = load_file(shipped_file(OFFLINE_FUSER))
    tokens = sum(len(x) for x in caches)
    for name, params in CODECS:
        codec = get_codec(name[:2] if name.startswith("tc") else name, store.geometry,
                          {"calibration": cal, **params} if name.startswith("tc") else None)
        print(row("offline, real fused caches", name, timed(codec, caches), tokens), flush=True)
    if args.compare:
        codec = get_codec("tc", store.geometry, {"calibration": load_file(args.compare)})
        print(row("offline, real fused caches", "tc[compare]", timed(codec, caches), tokens), flush=True)
    if args.no_qwen3:
        return
    rng = np.random.default_rng(0)
    mix = rng.normal(0, 1, (28, 2, 64, 1024)).astype(np.float32)
    t0 = time.perf_counter()
    qcal = tf.fit([synthetic(rng, mix, 150) for _ in range(16)], tf.FitOptions(rope_theta=1e6))
    print(f"qwen3-0.6b calibration: fitted in {time.perf_counter() - t0:.0f} s, {len(qcal.to_bytes()) / 1e6:.0f} MB")
    geometry = {"layers": 28, "kv_heads": 8, "head_dim": 128}
    test = [synthetic(rng, mix, 150) for _ in range(2)]
    for name, params in CODECS[:2]:
        codec = get_codec(name, geometry, {"calibration": qcal, **params} if name == "tc" else None)
        print(row("qwen3-0.6b, synthetic caches", name, timed(codec, test), 300), flush=True)


if __name__ == "__main__":
    main()
