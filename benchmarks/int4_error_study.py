"""Where int4's error is: relative RMS error of keys and values under the shipped int4
codec and under alternative quantisers, on the real caches of a float32 store.

Each passage is quantised on its own (groups start at its first token; in a store,
key groups run along the segment and may span passages). Numpy only (no model runs).
The default store is the float32 one `codec_quality.py`
builds (`--questions 200`); keys are stored post-RoPE, so the "before RoPE"
variants un-rotate them with the receiver's RoPE (Qwen2: rotate-half, theta
from its config) at their canonical positions (template prefix + offset),
quantise, and rotate back.

    python benchmarks/int4_error_study.py [--store DIR] [--receiver DIR]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench_common as bc
import numpy as np

DEFAULT_STORE = bc.WORK_DIR / "p3-closed-auto-s0-n41-float32"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default=str(DEFAULT_STORE))
    ap.add_argument("--receiver", default=str(bc.RECEIVER))
    return ap.parse_args(argv)


def rotate(k: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, sign: int) -> np.ndarray:
    """RoPE (rotate-half) by +angle (sign 1) or -angle (sign -1); k is (tokens, layers, heads, dim)."""
    half = k.shape[-1] // 2
    angle = np.outer(pos, inv_freq) * sign
    cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None, None, :]
    sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None, None, :]
    return k * cos + np.concatenate([-k[..., half:], k[..., :half]], -1) * sin


def int4(x: np.ndarray, geometry: dict, **params) -> np.ndarray:
    """The int4 codec with these parameters (the rest: today's defaults), encoded and decoded."""
    from cachegraft_cli.store.codecs import get_codec

    codec = get_codec("int4", geometry, params)
    return codec.decode(codec.encode(x), 0, len(x))


def as_stored(caches: list[np.ndarray], geometry: dict, **params) -> list[np.ndarray]:
    """The passages quantised as one segment holds them: concatenated, so key groups run
    along the segment and a group may span two passages (the error study's other rows
    start each passage's groups at its first token)."""
    joined = int4(np.concatenate(caches), geometry, **params)
    return np.split(joined, np.cumsum([len(c) for c in caches])[:-1])


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).sum() / (a ** 2).sum()))


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from cachegraft_cli.lm.template import PromptTemplate
    from cachegraft_cli.store.store import CacheStore

    args = parse_args(argv)
    store = CacheStore.open(args.store)
    caches = store.read([r.id for r in sorted(store.rows(), key=lambda r: (r.segment, r.offset))])
    config = AutoConfig.from_pretrained(args.receiver)
    prefix = len(PromptTemplate.for_tokenizer(AutoTokenizer.from_pretrained(args.receiver)).prefix_ids())
    layers, _, heads, dim = caches[0].shape[1:]
    geometry = {"layers": layers, "kv_heads": heads, "head_dim": dim}
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {})["rope_theta"]
    inv_freq = float(theta) ** (-np.arange(0, dim, 2) / dim)
    errors: dict[str, list[float]] = {}
    for x in caches:
        k, v, pos = x[:, :, 0], x[:, :, 1], prefix + np.arange(len(x))
        raw = rotate(k, pos, inv_freq, -1)
        unrotated = np.stack([raw, v], axis=2)
        sym = {"zero_point": False}
        variants = {
            "keys: symmetric, 32-token groups (int4 before zero points)":
                (k, int4(x, geometry, key_group=32, **sym)[:, :, 0]),
            **{f"keys: zero point, {g}-token groups": (k, int4(x, geometry, key_group=g)[:, :, 0])
               for g in (32, 64, 128, 256)},
            "keys: before RoPE, zero point, 128-token groups":
                (k, rotate(int4(unrotated, geometry, key_group=128)[:, :, 0], pos, inv_freq, 1)),
            "values: symmetric, 64-channel groups (int4 before zero points)":
                (v, int4(x, geometry, value_group=64, **sym)[:, :, 1]),
            "values: symmetric, 32-channel groups": (v, int4(x, geometry, value_group=32, **sym)[:, :, 1]),
            **{f"values: zero point, {g}-channel groups": (v, int4(x, geometry, value_group=g)[:, :, 1])
               for g in (64, 32, 16)},
        }
        for name, (exact, approx) in variants.items():
            errors.setdefault(name, []).append(rel_rms(exact, approx))
    settings = [("symmetric", 32, {"zero_point": False}), *[("zero point", g, {}) for g in (32, 64, 128, 256)]]
    for name, g, params in settings:
        for exact, approx in zip(caches, as_stored(caches, geometry, key_group=g, **params)):
            errors.setdefault(f"keys as stored (groups span passages): {name}, {g}-token groups", []).append(
                rel_rms(exact[:, :, 0], approx[:, :, 0]))
    means = {name: float(np.mean(e)) for name, e in errors.items()}
    rows = [[name, f"{value:.4f}"] for name, value in means.items()]
    bc.print_table(f"int4 error study: {len(caches)} passages of {Path(args.store).name}",
                   ["quantiser", "relative RMS error (mean over passages)"], rows)
    print(json.dumps({"bench": "int4_error_study", "passages": len(caches), "rel_rms": means}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
