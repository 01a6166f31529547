"""The transform codec's rounding and groups: bytes against the model-weighted error, with and without
a deadzone (real offline pair, no model run after the caches and error forms).

Each variant is the calibration the offline fuser ships with its deadzone set, all its steps
scaled by a multiplier and `--group` tokens per coded group (`--refit`: fitted afresh as `store
calibrate` fitted the shipped one, weighted by the receiver with the shipped per-layer steps, on
the calibration corpus, so that its predictions and entropy classes see the variant's own
rounding). Each codes the lossless float32 stores of the fidelity benchmark's sets (their
questions' paragraphs and distractors, the same stores `codec_fidelity.py` builds).
Reported per variant and multiplier:

- bytes per token the codec writes (its code words, heads and positions; zarr's zstd compresses
  the code rows' zero padding away, so these are the stored bytes to within a percent);
- the error, each layer and K/V in units of the shipped calibration's step for it, squared and
  summed: in the weighted space where the calibration measures cost, with the layer steps set
  where each layer's error costs the same, this sum is the second-order model of KL the layer
  steps were fitted under;
- and, per deadzone, the bytes at the error of the first deadzone at multiplier 1 (log-log interpolation).

The deadzone (`FitOptions.deadzone`) is an encoder's choice that any reader decodes. Whatever wins
here is confirmed with `codec_fidelity.py` (KL, dNLL; `--write DIR` writes the calibrations for its
`tcfile:`) before any default changes.

    python benchmarks/tc_deadzone.py [--deadzones 0,0.1,0.2] [--multipliers 0.9,1,1.12,1.25] [--group 64] [--refit]
"""

from __future__ import annotations

import argparse
import functools
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import bench_common as bc
import numpy as np
from codec_fidelity import OFFLINE_FUSER, SETS, calibration_store, sample

FIDELITY_TAG = OFFLINE_FUSER.split(":")[-1]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deadzones", default="0,0.1,0.2", help="in steps")
    ap.add_argument("--multipliers", default="0.9,1,1.12,1.25", help="of the shipped calibration's base steps")
    ap.add_argument("--sets", default=",".join(SETS), help="which of the fidelity benchmark's sets to code")
    ap.add_argument("--per-set", type=int, default=60, help="the fidelity benchmark's stores of this many questions")
    ap.add_argument("--distractors", type=int, default=60)
    ap.add_argument("--calibration-passages", type=int, default=250)
    ap.add_argument("--base", default=None, help="the calibration the variants are derived from (default: the one "
                    "the offline fuser ships)")
    ap.add_argument("--group", type=int, default=16, help="tokens per entropy-coded group (the shipped: 16)")
    ap.add_argument("--write", default=None, help="write each variant's calibration into this directory, named "
                    "dz{DEADZONE}-x{MULTIPLIER}-g{GROUP}.safetensors (for codec_fidelity.py's tcfile:)")
    ap.add_argument("--refit", action="store_true", help="fit each variant on the calibration corpus (encoded here "
                    "if missing) instead of changing the shipped calibration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def test_caches(session, args) -> list[np.ndarray]:
    """The lossless caches of the fidelity benchmark's three sets (built here if missing)."""
    from cachegraft_cli.store import CacheStore

    out = []
    for name in args.sets.split(","):
        file = SETS[name]
        passages, _ = sample(str((bc.QA_DATA / file).resolve()), args.per_set, args.distractors, args.seed)
        url = str(bc.WORK_DIR / f"fidelity-{FIDELITY_TAG}-{bc.DTYPE or 'auto'}-{name}-n{len(passages)}-float32")
        if not complete(url, passages):
            bc.ensure_store(url, passages, session(), codec="float32")
        store = CacheStore.open(url)
        out += store.read([row.id for row in store.rows()])
    return out


def complete(url: str, passages) -> bool:
    """Whether the store at `url` already holds every passage (so no model needs to load)."""
    from cachegraft_cli.store import CacheStore

    try:
        store = CacheStore.open(url)
    except Exception:  # noqa: BLE001 - missing or unreadable: encode it
        return False
    return all(p.id in store for p in passages)


def unrotated(cal, caches: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each cache's keys without RoPE and its values, as `cal` splits them (computed once: every
    variant of one base calibration shares its angles and prefix)."""
    from cachegraft_cli.store import transform as tf

    offset = int(cal.info["position_offset"])
    return [tf.split(x, offset + np.arange(len(x)), cal.arrays["inv_freq"]) for x in caches]


def error_and_bytes(cal, reference, caches: list[np.ndarray], originals: list) -> tuple[float, float]:
    """(error per token, bytes per token) of `caches` (`originals`: their `unrotated` split) through
    the codec with calibration `cal`: the weighted error of each layer and K/V in units of
    `reference`'s step for it, squared, summed."""
    from cachegraft_cli.store import transform as tf
    from cachegraft_cli.store.codecs import get_codec

    codec = get_codec("tc", cal.info["geometry"], {"calibration": cal})
    inv, offset = cal.arrays["inv_freq"], codec.offset
    err, stored, tokens = 0.0, 0.0, 0
    for x, (kx, vx) in zip(caches, originals):
        parts = codec.encode(x)
        y = codec.decode(parts, 0, len(x))
        stored += 4 * parts["head"][:, 0].sum() + parts["head"].nbytes + parts["pos"].nbytes
        ky, vy = tf.split(y, offset + np.arange(len(x)), inv)
        for layer in range(cal.layers):
            for kv, (a, b) in enumerate(((kx, ky), (vx, vy))):
                # the analysis matrix is orthonormal in the weighted space: this is the weighted norm
                coefficients = (a[:, layer] - b[:, layer]) @ cal.work[f"basis.{layer}.{'kv'[kv]}"]
                err += float((coefficients ** 2).sum()) / float(reference.work["step"][layer, kv]) ** 2
        tokens += len(x)
    return err / tokens, stored / tokens


def at_error(points: list[tuple[float, float]], target: float) -> float:
    """Bytes at `target` error: log-log linear through the two measured (error, bytes) points
    nearest it (between them where they bracket it, else the line through the nearest two)."""
    pts = sorted(points)
    e, b = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    i = int(np.clip(np.searchsorted(e, np.log(target)), 1, len(e) - 1))
    slope = (b[i] - b[i - 1]) / (e[i] - e[i - 1])
    return float(np.exp(b[i - 1] + slope * (np.log(target) - e[i - 1])))


def main(argv=None) -> int:
    from cachegraft_cli.encoding.calibration import load_file, shipped_file
    from cachegraft_cli.store.codecs import raw_bf16_bytes_per_token

    args = parse_args(argv)
    bc.set_threads(args.threads)
    session = functools.cache(lambda: bc.session_for(OFFLINE_FUSER, args.seed))  # loaded only where needed
    start = bc.machine()
    t0 = time.perf_counter()
    shipped = load_file(args.base or shipped_file(OFFLINE_FUSER))
    caches = test_caches(session, args)
    originals, raw = unrotated(shipped, caches), raw_bf16_bytes_per_token(shipped.info["geometry"])
    make = refitter(session, args, shipped) if args.refit else \
        (lambda dz, m: changed(shipped, dz, m, args.group))
    bc.log(f"caches: {sum(map(len, caches)):,} tokens scored ({time.perf_counter() - t0:.0f}s)")
    variants, multipliers = args.deadzones.split(","), [float(v) for v in args.multipliers.split(",")]
    if 1.0 not in multipliers:
        raise SystemExit("--multipliers must include 1 (the shipped steps: the error compared at)")
    rows, curves = [], {}
    for variant in variants:
        dz = float(variant)
        for m in multipliers:
            cal = make(dz, m)
            if args.write:
                Path(args.write, f"dz{dz:g}-x{m:g}-g{args.group}.safetensors").write_bytes(cal.to_bytes())
            err, per_token = error_and_bytes(cal, shipped, caches, originals)
            curves.setdefault(variant, []).append((err, per_token))
            rows.append([variant, m, f"{per_token:,.0f}", f"{per_token / raw:.4f}", f"{err:.2f}"])
            bc.log(f"{variant} x{m}: {per_token:,.0f} B/token, error {err:.2f} ({time.perf_counter() - t0:.0f}s)")
    first = curves[variants[0]]
    target = first[multipliers.index(1.0)][0]
    summary = [[v, f"{at_error(p, target):,.0f}", f"{at_error(p, target) / raw:.4f}",
                f"{100 * (at_error(p, target) / at_error(first, target) - 1):+.1f}%"] for v, p in curves.items()]
    bc.print_table(f"tc deadzones (in steps), {args.group}-token groups: bytes and summed per-layer error",
                   ["deadzone", "step x", "B/token", "x raw bf16", "error (steps^2)"], rows)
    bc.print_table(f"bytes at the first deadzone's error at x1 ({target:.2f})",
                   ["deadzone", "B/token", "x raw bf16", "vs first"], summary)
    print(f"machine at start: {start}; at end: loadavg {bc.machine()['loadavg']}; {time.perf_counter() - t0:.0f}s")
    bc.emit({"bench": "tc_deadzone", "rows": rows, "summary": summary, "target_error": target})
    return 0


def refitter(session, args, shipped):
    """A function (deadzone, multiplier) -> calibration fitted as `store calibrate` fitted
    the shipped one, on the calibration corpus (encoded float32 here if missing)."""
    from cachegraft_cli.encoding.calibration import WEIGHTING, receiver_roots, rope_theta_of
    from cachegraft_cli.store import CacheStore, transform as tf

    url = calibration_store(session(), SimpleNamespace(calibration_store=None,
                                                      calibration_passages=args.calibration_passages))
    store = CacheStore.open(url)
    ids = [row.id for row in store.rows()]
    roots, caches = receiver_roots(store, ids), store.read(ids)
    base = tf.FitOptions(key_step=shipped.info["key_step"], value_step=shipped.info["value_step"],
                         layer_steps=tuple(map(tuple, shipped.info["layer_steps"])),
                         rope_theta=rope_theta_of(store.identity), position_offset=len(store.prefix_token_ids))

    def make(deadzone: float, multiplier: float):
        settings = replace(base, key_step=base.key_step * multiplier, value_step=base.value_step * multiplier,
                           deadzone=deadzone, group=args.group)
        return tf.fit(caches, settings, source=url, roots=roots, weighting=WEIGHTING)

    return make


def changed(cal, deadzone: float, multiplier: float, group: int = 16):
    """`cal` with its deadzone set, every step scaled and `group` tokens per coded group (its
    predictions and classes as fitted; its code rows widened in proportion to the group)."""
    from cachegraft_cli.store import transform as tf

    arrays = {**cal.arrays, "step": (cal.arrays["step"] * multiplier).astype(np.float32)}
    info = {**cal.info, "deadzone": deadzone, "group": group,
            "key_step": round(cal.info["key_step"] * multiplier, 4),
            "value_step": round(cal.info["value_step"] * multiplier, 4),
            "group_words": -(-cal.info["group_words"] * group // cal.info["group"]),
            "bits_per_element": None,  # measured on the fit's own passages at its own rounding: no longer so
            "derived_from": {"sha256": cal.sha256, "by": f"benchmarks/tc_deadzone.py: deadzone {deadzone:g}, "
                                                        f"{group}-token groups, steps x{multiplier:g}"}}
    return tf.Calibration(arrays, info)


if __name__ == "__main__":
    raise SystemExit(main())
