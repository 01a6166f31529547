"""The transform codec's CPU per token, encode and decode, against int8's (one thread).

Two cases: the offline receiver's real fused caches (the first 6 passages of a float32 store,
e.g. one `codec_fidelity.py` made) with the calibration the offline fuser ships; and the
Qwen3-0.6B geometry (28 layers x 8 KV heads x 128) on synthetic caches with structure (64
shared latent features per token plus noise), calibrated on 2,400 of them. `time.process_time`.

    python benchmarks/tc_speed.py --store FLOAT32_STORE
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import time

import numpy as np

OFFLINE_FUSER = "builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135"


def timed(codec, caches: list) -> tuple[float, float, int]:
    """(encode, decode) CPU microseconds per token, and groups coded at coarser steps."""
    codec.encode(caches[0][:16])  # tables loaded, models built
    t = time.process_time()
    parts = [codec.encode(x) for x in caches]
    enc = time.process_time() - t
    t = time.process_time()
    for p, x in zip(parts, caches):
        codec.decode(p, 0, len(x))
    dec = time.process_time() - t
    n = sum(len(x) for x in caches)
    shifted = sum(int((p["head"][:, 2] > 0).sum()) for p in parts) if "head" in parts[0] else 0
    return 1e6 * enc / n, 1e6 * dec / n, shifted


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
    args = ap.parse_args()
    torch.set_num_threads(1)
    store = CacheStore.open(args.store)
    caches = store.read(store.ids()[:6])
    cal = load_file(shipped_file(OFFLINE_FUSER))
    for name in ("int8", "tc"):
        enc, dec, shifted = timed(get_codec(name, store.geometry, {"calibration": cal} if name == "tc" else None),
                                  caches)
        print(f"offline, real fused caches  {name:4s} encode {enc:7.0f} us/token  decode {dec:7.0f} us/token  "
              f"({sum(len(x) for x in caches)} tokens, {shifted} groups coded coarser)", flush=True)
    rng = np.random.default_rng(0)
    mix = rng.normal(0, 1, (28, 2, 64, 1024)).astype(np.float32)
    t0 = time.perf_counter()
    qcal = tf.fit([synthetic(rng, mix, 150) for _ in range(16)], tf.FitSettings(rope_theta=1e6))
    print(f"qwen3-0.6b calibration: fitted in {time.perf_counter() - t0:.0f} s, {len(qcal.to_bytes()) / 1e6:.0f} MB")
    geometry = {"layers": 28, "kv_heads": 8, "head_dim": 128}
    test = [synthetic(rng, mix, 150) for _ in range(2)]
    for name in ("int8", "tc"):
        enc, dec, shifted = timed(get_codec(name, geometry, {"calibration": qcal} if name == "tc" else None), test)
        print(f"qwen3-0.6b, synthetic caches  {name:4s} encode {enc:7.0f} us/token  decode {dec:7.0f} us/token  "
              f"(300 tokens, {shifted} groups coded coarser)", flush=True)


if __name__ == "__main__":
    main()
