"""Transform-coding probe: how few bits the fused caches of a store need, stage by stage (numpy).

Not a codec: a measurement that decides which stages a transform codec should have. From
a lossless float32 store, per layer and for keys (un-rotated: RoPE removed at their
canonical positions) and values separately:

1. prediction (optional): each layer's keys from the previous layer's *reconstructed* keys,
   its values from its own reconstructed keys and the previous layer's reconstructed values,
   by least-squares linear maps fitted on calibration passages (the decoder can follow);
2. a decorrelating transform (optional): the PCA basis of the calibration residuals;
3. one uniform quantiser step per layer and K/V: `step` times the RMS spread of that layer's
   calibration keys (or values), so components with little variance fall to zero by themselves
   and every ablation is measured at about the same error;
4. static per-component entropy models (optional) fitted on the calibration symbols (a smoothed
   histogram with an escape): the bits are the cross-entropy of every passage's symbols
   under those models, what a static ANS or range coder spends (within ~0.01 bit a symbol;
   no coder is run). The models and maps are stored once per store and not counted.

The reconstruction (keys rotated back) is written to a float32 store so that
`codec_fidelity.py` measures it against the lossless store with the model itself.
Calibration: the first `calibrate` share of the store's passages (store order), as a
codec fitted when a store is created would see them; bits are reported for all passages
and for the held-out rest.

    python benchmarks/tc_probe.py --store DIR [--step 0.25] [--no-predict] [--no-transform]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import bench_common as bc
import numpy as np

ESCAPE_RANGE = 64  # symbols beyond +-this are escaped: the escape's bits plus an Elias-gamma code


@dataclass
class Stage:
    predict: bool = True
    transform: bool = True
    step: float = 0.25  # keys' quantiser step, in RMS units of the layer's calibration keys' spread
    value_step: float | None = None  # the values' (None: `step`)
    entropy: bool = True  # False: each component's symbols at a fixed width (its calibration range)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a float32 store (codec_fidelity.py / codec_quality.py build one)")
    ap.add_argument("--receiver", default=str(bc.RECEIVER))
    ap.add_argument("--step", type=float, default=0.25)
    ap.add_argument("--value-step", type=float, default=None)
    ap.add_argument("--calibrate", type=float, default=0.5)
    ap.add_argument("--no-predict", action="store_true")
    ap.add_argument("--no-transform", action="store_true")
    ap.add_argument("--no-entropy", action="store_true")
    return ap.parse_args(argv)


# ---------------------------------------------------------------- RoPE


def rope(receiver: str, prefix: int, head_dim: int):
    """(un-rotate, rotate) functions for keys `(tokens, layers, heads, dim)` at canonical positions
    (the template prefix, then the passage's own offsets): Qwen2's rotate-half RoPE."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(receiver)
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {})["rope_theta"]
    inv_freq = float(theta) ** (-np.arange(0, head_dim, 2) / head_dim)

    def turn(k: np.ndarray, sign: int) -> np.ndarray:
        pos = prefix + np.arange(len(k))
        angle = np.outer(pos, inv_freq) * sign
        cos = np.concatenate([np.cos(angle)] * 2, -1)[:, None, None, :]
        sin = np.concatenate([np.sin(angle)] * 2, -1)[:, None, None, :]
        half = k.shape[-1] // 2
        return k * cos + np.concatenate([-k[..., half:], k[..., :half]], -1) * sin

    return (lambda k: turn(k, -1)), (lambda k: turn(k, 1))


# ---------------------------------------------------------------- the coder, fitted on calibration


class LayerCoder:
    """One layer's keys or values: prediction map, PCA basis, step, entropy models."""

    def __init__(self, stage: Stage, step: float):
        self.stage, self.step = stage, step

    def fit(self, x: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        """Fit on calibration rows `x` `(tokens, channels)` given the reconstructed `context`;
        returns the calibration reconstruction (the next layer's context)."""
        self.map = None
        if self.stage.predict and context is not None:
            design = np.hstack([context, np.ones((len(context), 1))])
            self.map = np.linalg.lstsq(design, x, rcond=None)[0]
        r = x - self.predict(context)
        self.mean = r.mean(0)
        centred = r - self.mean
        if self.stage.transform:
            _, _, vt = np.linalg.svd(centred, full_matrices=False)
            self.basis = vt.T
        else:
            self.basis = np.eye(x.shape[1])
        # in units of the layer's own spread (not its residual's): with or without prediction and
        # transform, the same step gives about the same error, so the ablations compare bits at equal error
        self.step_size = self.step * float(np.sqrt(((x - x.mean(0)) ** 2).mean()))
        symbols = self.symbols(x, context)
        self.models = [_model(symbols[:, j]) for j in range(symbols.shape[1])]
        spans = symbols.max(0) - symbols.min(0) + 1
        self.widths = np.ceil(np.log2(np.maximum(spans, 1)))  # fixed-length codes (escapes aside)
        return self.reconstruct(symbols, context)

    def predict(self, context: np.ndarray | None) -> np.ndarray:
        if self.map is None or context is None:
            return 0.0  # type: ignore[return-value]
        return np.hstack([context, np.ones((len(context), 1))]) @ self.map

    def symbols(self, x: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        z = (x - self.predict(context) - self.mean) @ self.basis
        return np.rint(z / self.step_size).astype(np.int64)

    def reconstruct(self, symbols: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        return (symbols * self.step_size) @ self.basis.T + self.mean + self.predict(context)

    def bits(self, symbols: np.ndarray) -> float:
        if not self.stage.entropy:  # fixed widths; a symbol outside its calibration range pays an escape
            lo, hi = -(2 ** (self.widths - 1)), 2 ** (self.widths - 1) - 1
            out = symbols[(symbols < lo) | (symbols > hi)]
            return float(self.widths.sum() * len(symbols) + (2 * np.floor(np.log2(np.abs(out) + 1)) + 2).sum())
        return float(sum(_cost(self.models[j], symbols[:, j]) for j in range(symbols.shape[1])))


def _model(column: np.ndarray) -> np.ndarray:
    """-log2 probabilities of symbols -R..R and the escape (last), add-half smoothed."""
    counts = np.full(2 * ESCAPE_RANGE + 2, 0.5)
    inside = np.abs(column) <= ESCAPE_RANGE
    np.add.at(counts, column[inside] + ESCAPE_RANGE, 1)
    counts[-1] += (~inside).sum()
    return -np.log2(counts / counts.sum())


def _cost(model: np.ndarray, column: np.ndarray) -> float:
    inside = np.abs(column) <= ESCAPE_RANGE
    out = column[~inside]
    escape = len(out) * model[-1] + float((2 * np.floor(np.log2(np.abs(out) + 1)) + 2).sum())
    return float(model[column[inside] + ESCAPE_RANGE].sum()) + escape


class StoreCoder:
    """All layers, keys then values, in decoding order."""

    def __init__(self, stage: Stage, layers: int):
        self.keys = [LayerCoder(stage, stage.step) for _ in range(layers)]
        value_step = stage.step if stage.value_step is None else stage.value_step
        self.values = [LayerCoder(stage, value_step) for _ in range(layers)]

    def run(self, k: np.ndarray, v: np.ndarray, fit: bool) -> tuple[np.ndarray, np.ndarray, float, float]:
        """(reconstructed keys, values, key bits, value bits) of `(tokens, layers, channels)` rows."""
        rk, rv = np.empty_like(k), np.empty_like(v)
        kbits = vbits = 0.0
        for layer in range(k.shape[1]):
            kctx = rk[:, layer - 1] if layer else None
            rk[:, layer], b = self._one(self.keys[layer], k[:, layer], kctx, fit)
            kbits += b
            vctx = np.hstack([rk[:, layer]] + ([rv[:, layer - 1]] if layer else []))
            rv[:, layer], b = self._one(self.values[layer], v[:, layer], vctx, fit)
            vbits += b
        return rk, rv, kbits, vbits

    @staticmethod
    def _one(coder: LayerCoder, x, context, fit: bool):
        if fit:
            coder.fit(x, context)
        symbols = coder.symbols(x, context)
        return coder.reconstruct(symbols, context), coder.bits(symbols)


# ---------------------------------------------------------------- over a store


def probe(store_url: str, receiver: str, stage: Stage, calibrate: float = 0.5, out_url: str | None = None) -> dict:
    """Fit on the store's first passages, code every passage; write the reconstruction to `out_url`."""
    from cachegraft_cli.store import CacheStore

    store = CacheStore.open(store_url)
    rows = sorted(store.rows(), key=lambda r: (r.segment, r.offset))
    caches = store.read([r.id for r in rows])
    layers, _, heads, dim = caches[0].shape[1:]
    unrotate, rotate = rope(receiver, len(store.prefix_token_ids), dim)
    flat = [(unrotate(x[:, :, 0]).reshape(len(x), layers, heads * dim), x[:, :, 1].reshape(len(x), layers, -1))
            for x in caches]
    n_cal = max(1, int(len(flat) * calibrate))
    coder = StoreCoder(stage, layers)
    coder.run(np.concatenate([k for k, _ in flat[:n_cal]]), np.concatenate([v for _, v in flat[:n_cal]]), fit=True)
    recon, kb, vb, held = [], [0.0, 0.0], [0.0, 0.0], [0, 0]
    for i, (k, v) in enumerate(flat):
        rk, rv, kbits, vbits = coder.run(k, v, fit=False)
        part = 0 if i < n_cal else 1
        kb[part] += kbits
        vb[part] += vbits
        held[part] += len(k)
        keys = rotate(rk.reshape(len(k), layers, heads, dim))
        recon.append(np.stack([keys, rv.reshape(len(k), layers, heads, dim)], axis=2).astype(np.float32))
    per_token = layers * heads * dim  # elements of K (or V) per token
    tokens = sum(held)
    result = {"store": store_url, "stage": stage.__dict__, "tokens": tokens, "calibration_tokens": held[0],
              "key_bits": sum(kb) / tokens / per_token, "value_bits": sum(vb) / tokens / per_token,
              "heldout_key_bits": kb[1] / max(held[1], 1) / per_token,
              "heldout_value_bits": vb[1] / max(held[1], 1) / per_token,
              "key_rel_err": _rel([x[:, :, 0] for x in caches], [r[:, :, 0] for r in recon]),
              "value_rel_err": _rel([x[:, :, 1] for x in caches], [r[:, :, 1] for r in recon])}
    result["bits"] = (result["key_bits"] + result["value_bits"]) / 2
    result["bytes_per_token"] = result["bits"] * 2 * per_token / 8
    result["ratio"] = result["bits"] / 16
    if out_url:
        _write(store, rows, recon, out_url)
    return result


def _rel(exact: list[np.ndarray], approx: list[np.ndarray]) -> float:
    num = sum(float(((a - b) ** 2).sum()) for a, b in zip(exact, approx))
    return float(np.sqrt(num / sum(float((a ** 2).sum()) for a in exact)))


def _write(src, rows, recon: list[np.ndarray], url: str) -> None:
    """A float32 store of the reconstructions, with the source's identity and an index of its own."""
    import shutil

    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store import CacheStore

    shutil.rmtree(url, ignore_errors=True)
    dst = CacheStore.create(url, dict(src.identity), src.prefix(), src.kinds)
    with dst.writer({"tool": "benchmarks/tc_probe.py"}) as w:
        for row, x in zip(rows, recon):
            w.add(row, {"fused": x})
    build_store_index(url, "bm25")


def main(argv=None) -> int:
    args = parse_args(argv)
    stage = Stage(predict=not args.no_predict, transform=not args.no_transform, step=args.step,
                  value_step=args.value_step, entropy=not args.no_entropy)
    result = probe(args.store, args.receiver, stage, args.calibrate)
    print(json.dumps({"bench": "tc_probe", **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
