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


def per_channel_asym(k: np.ndarray, group: int) -> np.ndarray:
    """Keys with one scale and zero point per channel per `group` tokens (16 levels)."""
    out = np.empty_like(k)
    for s in range(0, len(k), group):
        out[s:s + group] = _asym(k[s:s + group], axis=0)
    return out


def per_token_asym(v: np.ndarray, group: int) -> np.ndarray:
    """Values with one scale and zero point per token per `group` channels (16 levels)."""
    return _asym(v.reshape(v.shape[:-1] + (-1, group)), axis=-1).reshape(v.shape)


def _asym(x: np.ndarray, axis: int) -> np.ndarray:
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    scale = np.where(hi > lo, (hi - lo) / 15, 1)
    return np.clip(np.round((x - lo) / scale), 0, 15) * scale + lo


def int4(x: np.ndarray, geometry: dict, **params) -> np.ndarray:
    """The shipped symmetric int4 codec (with group parameters), encoded and decoded."""
    from cachegraft_cli.store.codecs import get_codec

    codec = get_codec("int4", geometry, params)
    return codec.decode(codec.encode(x), 0, len(x))


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).sum() / (a ** 2).sum()))


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from cachegraft_cli.store.store import CacheStore
    from cachegraft_cli.template import PromptTemplate

    args = parse_args(argv)
    store = CacheStore.open(args.store)
    caches = store.read(store.ids())
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
        variants = {
            "keys: shipped int4 (symmetric, per channel, 32-token groups)": (k, int4(x, geometry)[:, :, 0]),
            "keys: symmetric, 16-token groups": (k, int4(x, geometry, key_group=16)[:, :, 0]),
            "keys: asymmetric, 32-token groups": (k, per_channel_asym(k, 32)),
            "keys: asymmetric, 64-token groups": (k, per_channel_asym(k, 64)),
            "keys: before RoPE, symmetric, 32-token groups":
                (k, rotate(int4(unrotated, geometry)[:, :, 0], pos, inv_freq, 1)),
            "keys: before RoPE, asymmetric, 32-token groups": (k, rotate(per_channel_asym(raw, 32), pos, inv_freq, 1)),
            "values: shipped int4 (symmetric, per token, 64-channel groups)": (v, int4(x, geometry)[:, :, 1]),
            "values: symmetric, 32-channel groups": (v, int4(x, geometry, value_group=32)[:, :, 1]),
            "values: symmetric, 16-channel groups": (v, int4(x, geometry, value_group=16)[:, :, 1]),
            "values: asymmetric, 64-channel groups": (v, per_token_asym(v, 64)),
            "values: asymmetric, 32-channel groups": (v, per_token_asym(v, 32)),
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
