"""Where int4's error is: relative RMS error of keys and values under the shipped int4
codec and under alternative quantisers, on the real caches of a float32 store.

Numpy only (no model runs). The default store is the float32 one `p3_codecs.py`
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

import numpy as np

import bench_common as bc

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


def per_channel(k: np.ndarray, group: int, asymmetric: bool) -> np.ndarray:
    """Quantise-dequantise keys with one scale (and zero point) per channel per `group` tokens."""
    out = np.empty_like(k)
    for s in range(0, len(k), group):
        out[s:s + group] = _quantise(k[s:s + group], axis=0, asymmetric=asymmetric)
    return out


def per_token(v: np.ndarray, group: int, asymmetric: bool) -> np.ndarray:
    """Quantise-dequantise values with one scale (and zero point) per token per `group` channels."""
    blocks = v.reshape(v.shape[:-1] + (-1, group))
    return _quantise(blocks, axis=-1, asymmetric=asymmetric).reshape(v.shape)


def _quantise(x: np.ndarray, axis: int, asymmetric: bool) -> np.ndarray:
    if asymmetric:  # 16 levels between min and max
        lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
        scale = np.where(hi > lo, (hi - lo) / 15, 1)
        return np.clip(np.round((x - lo) / scale), 0, 15) * scale + lo
    scale = np.abs(x).max(axis, keepdims=True) / 7  # symmetric, levels -7..7 (the shipped codec)
    scale = np.where(scale > 0, scale, 1)
    return np.clip(np.round(x / scale), -7, 7) * scale


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).sum() / (a ** 2).sum()))


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from cachegraft_cli.store.codecs import get_codec
    from cachegraft_cli.store.store import CacheStore
    from cachegraft_cli.template import PromptTemplate

    args = parse_args(argv)
    store = CacheStore.open(args.store)
    caches = store.read(store.ids())
    config = AutoConfig.from_pretrained(args.receiver)
    prefix = len(PromptTemplate.for_tokenizer(AutoTokenizer.from_pretrained(args.receiver)).prefix_ids())
    layers, _, heads, dim = caches[0].shape[1:]
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {})["rope_theta"]
    inv_freq = float(theta) ** (-np.arange(0, dim, 2) / dim)
    codec = get_codec("int4", {"layers": layers, "kv_heads": heads, "head_dim": dim})
    errors: dict[str, list[float]] = {}
    for x in caches:
        k, v, pos = x[:, :, 0], x[:, :, 1], prefix + np.arange(len(x))
        shipped = codec.decode(codec.encode(x), 0, len(x))
        raw = rotate(k, pos, inv_freq, -1)
        variants = {
            "keys: shipped int4 (symmetric, per channel, 32-token groups)": (k, shipped[:, :, 0]),
            "keys: symmetric, 16-token groups": (k, per_channel(k, 16, False)),
            "keys: asymmetric, 32-token groups": (k, per_channel(k, 32, True)),
            "keys: asymmetric, 64-token groups": (k, per_channel(k, 64, True)),
            "keys: before RoPE, symmetric, 32-token groups": (k, rotate(per_channel(raw, 32, False), pos, inv_freq, 1)),
            "keys: before RoPE, asymmetric, 32-token groups": (k, rotate(per_channel(raw, 32, True), pos, inv_freq, 1)),
            "values: shipped int4 (symmetric, per token, 64-channel groups)": (v, shipped[:, :, 1]),
            "values: symmetric, 32-channel groups": (v, per_token(v, 32, False)),
            "values: symmetric, 16-channel groups": (v, per_token(v, 16, False)),
            "values: asymmetric, 64-channel groups": (v, per_token(v, 64, True)),
            "values: asymmetric, 32-channel groups": (v, per_token(v, 32, True)),
        }
        for name, (exact, approx) in variants.items():
            errors.setdefault(name, []).append(rel_rms(exact, approx))
    means = {name: float(np.mean(e)) for name, e in errors.items()}
    rows = [[name, f"{value:.4f}"] for name, value in means.items()]
    bc.print_table(f"int4 error study: {len(caches)} passages of {Path(args.store).name}",
                   ["quantiser", "relative RMS error (mean over passages)"], rows)
    print(json.dumps({"bench": "int4_error_study", "passages": len(caches), "rel_rms": means}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
