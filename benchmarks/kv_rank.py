"""How low-rank are a store's caches? Per receiver layer, the share of the keys' and values'
energy that a PCA basis keeps at rank r: the basis (the passages' mean plus the top r
directions over all heads of the layer) is fitted on the first half of the passages and
scored on the second half. Keys are scored as stored (after RoPE) and un-rotated to their
positions before RoPE (the receiver's RoPE at the canonical positions: template prefix +
offset), as a low-rank codec would store them. Numpy only (no model runs).

    python benchmarks/kv_rank.py --store DIR [--receiver DIR] [--ranks 8,16,32,48,64,96]

Prints, per kind, the energy kept (mean over layers and worst layer) and the relative RMS
error that truncation alone leaves (sqrt of the energy lost), then one JSON line.
"""

from __future__ import annotations

import argparse

import bench_common as bc
import numpy as np
from int4_error_study import rotate


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True, help="a lossless (bf16 or float32) store")
    ap.add_argument("--receiver", default=str(bc.RECEIVER), help="its receiver (for RoPE and the prefix length)")
    ap.add_argument("--ranks", default="8,16,32,48,64,96")
    return ap.parse_args(argv)


def kept_energy(fit: np.ndarray, test: np.ndarray, ranks: list[int]) -> list[float]:
    """Share of `test`'s second moment kept by the mean of `fit` plus its top-r principal directions."""
    mean = fit.mean(0)
    _, _, vt = np.linalg.svd(fit - mean, full_matrices=False)
    centred, total = test - mean, float((test ** 2).sum())
    return [1.0 - float(((centred - (centred @ vt[:r].T) @ vt[:r]) ** 2).sum()) / total for r in ranks]


def main(argv=None) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from cachegraft_cli.lm.template import PromptTemplate
    from cachegraft_cli.store.store import CacheStore

    args = parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    store = CacheStore.open(args.store)
    caches = [x.astype(np.float64) for x in store.read(store.ids())]
    config = AutoConfig.from_pretrained(args.receiver)
    prefix = len(PromptTemplate.for_tokenizer(AutoTokenizer.from_pretrained(args.receiver)).prefix_ids())
    layers, _, heads, dim = caches[0].shape[1:]
    theta = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {})["rope_theta"]
    inv_freq = float(theta) ** (-np.arange(0, dim, 2) / dim)
    views = {
        "keys after RoPE": [x[:, :, 0] for x in caches],
        "keys before RoPE": [rotate(x[:, :, 0], prefix + np.arange(len(x)), inv_freq, -1) for x in caches],
        "values": [x[:, :, 1] for x in caches],
    }
    half = len(caches) // 2
    figures: dict = {"store": args.store, "passages": len(caches), "tokens": int(sum(len(x) for x in caches)),
                     "dims_per_layer": heads * dim, "ranks": ranks}
    rows = []
    for name, xs in views.items():
        per_layer = np.array([kept_energy(np.concatenate([x[:, layer].reshape(len(x), -1) for x in xs[:half]]),
                                          np.concatenate([x[:, layer].reshape(len(x), -1) for x in xs[half:]]),
                                          ranks) for layer in range(layers)])
        mean, worst = per_layer.mean(0), per_layer.min(0)
        figures[name] = {"kept_mean": mean.round(4).tolist(), "kept_worst": worst.round(4).tolist(),
                         "rel_rms_mean": np.sqrt(np.clip(1 - mean, 0, None)).round(3).tolist()}
        rows += [[name, "kept (mean)", *[f"{v:.4f}" for v in mean]],
                 ["", "kept (worst layer)", *[f"{v:.4f}" for v in worst]],
                 ["", "rel RMS left (mean)", *[f"{np.sqrt(max(0.0, 1 - v)):.3f}" for v in mean]]]
    bc.print_table(f"{len(caches)} passages, {figures['tokens']} tokens, {layers} layers x {heads * dim} dims "
                   "(fit on the first half, scored on the second)", ["kind", "", *[f"r={r}" for r in ranks]], rows)
    bc.emit({"benchmark": "kv_rank", **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
