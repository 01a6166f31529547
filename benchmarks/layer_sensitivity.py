"""What the transform codec's error costs the receiver, layer by layer, and the steps that spend
bits where they count (real offline pair, no QA set).

On a calibration corpus (the offline preset's, `calibration_corpus.py`), each probe asks the
receiver about one passage's topic ("What does the text say about <title>?", BM25 top-3 from the
lossless store, graft, best-last) and takes its greedy answer from the lossless caches. Then, for
each layer and K/V alone, that layer's keys (or values) come from the `tc` store at the uniform
steps (every other layer exact), and the KL of the receiver's next-token distributions over the
question and answer is measured against the lossless ones.

Under the small-error model (KL of a layer ~ s x its relative step squared, and a component's bits
~ -log2 its step) the cost per bit is the same everywhere when each step is proportional to
s^(-1/2): `layer_steps` (multipliers of the key and value steps, geometric mean 1, clipped to
[1/4, 4]). `--out FILE` writes a calibration fitted with them on the whole calibration store, both
steps scaled so that it codes the calibration passages in as many bits as the uniform one; compare
the two with `codec_fidelity.py --codecs tc:0.25/0.35,tcfile:FILE`.

    python benchmarks/layer_sensitivity.py [--probes 48] [--out weighted.safetensors]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import bench_common as bc
import numpy as np

CLIP = 4.0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probes", type=int, default=48)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--key-step", type=float, default=0.25)
    ap.add_argument("--value-step", type=float, default=0.35)
    ap.add_argument("--calibration-passages", type=int, default=250)
    ap.add_argument("--fuser", default="builtin:qwen2.5-coder-0.5b+1.5b-squadshifts-qa-mix135")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the calibration fitted with the measured layer steps here")
    return ap.parse_args(argv)


def mixed(prompt, other, layer: int, kv: int):
    """`prompt` with one layer's keys (kv=0) or values (kv=1) taken from `other`."""
    from cachegraft_cli.lm.generation import Prompt

    past = [tuple(o[j] if (n == layer and j == kv) else p[j] for j in (0, 1))
            for n, (p, o) in enumerate(zip(prompt.past, other.past))]
    return Prompt(past, prompt.ids, prompt.positions)


def measure(args, session, exact_url: str, coded_url: str, titles: list[str]) -> np.ndarray:
    """Mean KL per (layer, K/V) over the probes `(L, 2)`."""
    from codec_fidelity import greedy_answer, log_probs, score

    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.lm.generation import stop_ids

    exact, coded = Asker(exact_url, session=session), Asker(coded_url, session=session)
    lm, stops = session.receiver, set(stop_ids(session.receiver))
    layers = exact.store.geometry["layers"]
    kl = np.zeros((layers, 2))
    t0 = time.perf_counter()
    for i, title in enumerate(titles):
        question = f"What does the text say about {title}?"
        hits = exact.retrieve(question, args.k)
        options = AskOptions("graft", args.k)
        ref = exact.build_prompt(question, hits, options)[1]
        other = coded.build_prompt(question, hits, options)[1]
        greedy = greedy_answer(lm, ref)
        rows = [ref] + [mixed(ref, other, layer, kv) for layer in range(layers) for kv in (0, 1)]
        got = log_probs(lm, rows, [greedy] * len(rows))
        for n in range(layers * 2):
            kl[n // 2, n % 2] += score(got[0], got[1 + n], got[1 + n], len(ref.ids), greedy, greedy, stops)["kl"]
        if (i + 1) % 8 == 0:
            bc.log(f"{i + 1}/{len(titles)} probes, {time.perf_counter() - t0:.0f}s")
    return kl / len(titles)


def allocation(kl: np.ndarray, steps: tuple[float, float]) -> np.ndarray:
    """Layer step multipliers `(L, 2)`: relative steps proportional to s^(-1/2), s = KL / step^2."""
    base = np.array(steps)[None, :]
    s = np.maximum(kl, 1e-9) / base**2
    relative = s**-0.5
    relative *= np.exp(np.log(base).mean() - np.log(relative).mean())  # the same mean log step
    return np.clip(relative / base, 1 / CLIP, CLIP)


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from codec_fidelity import calibration_store
    from codec_quality import bytes_per_token, transcode

    from cachegraft_cli.encoding.calibration import fit_from_store
    from cachegraft_cli.store import CacheStore
    from cachegraft_cli.store.transform import FitOptions, fit_to_ratio

    session = bc.session_for(args.fuser, args.seed)
    args.calibration_store = None
    exact_url = calibration_store(session, args)
    uniform = FitOptions(key_step=args.key_step, value_step=args.value_step)
    cal, _ = fit_from_store(exact_url, uniform)
    coded_url = f"{exact_url.removesuffix('-float32')}-tc{args.key_step}v{args.value_step}"
    transcode(exact_url, coded_url, "tc", {"calibration": cal})
    store = CacheStore.open(exact_url)
    rng = np.random.default_rng(args.seed)
    titles = [r.title for r in store.rows()]
    titles = [titles[i] for i in rng.choice(len(titles), size=min(args.probes, len(titles)), replace=False)]
    t0 = time.perf_counter()
    kl = measure(args, session, exact_url, coded_url, titles)
    steps = allocation(kl, (args.key_step, args.value_step))
    rows = [[layer, f"{kl[layer, 0]:.5f}", f"{kl[layer, 1]:.5f}", f"{steps[layer, 0]:.2f}", f"{steps[layer, 1]:.2f}"]
            for layer in range(len(kl))]
    bc.print_table(f"KL when one layer's keys or values are coded at {args.key_step}/{args.value_step} "
                   f"({len(titles)} probes, k = {args.k}, {time.perf_counter() - t0:.0f} s), and the layer steps",
                   ["layer", "KL keys", "KL values", "key step x", "value step x"], rows)
    print(f"sum over layers: keys {kl[:, 0].sum():.4f}, values {kl[:, 1].sum():.4f}; "
          f"uniform coded store {bytes_per_token(coded_url)['bytes_per_token']:,.0f} B/token")
    result = {"bench": "layer_sensitivity", "probes": len(titles), "k": args.k, "kl": kl.tolist(),
              "layer_steps": steps.tolist(), "uniform_bits": cal.info["bits_per_element"]}
    if args.out:
        weighted = replace(uniform, layer_steps=tuple(map(tuple, steps.tolist())),
                           rope_theta=cal.info["rope_theta"], position_offset=cal.info["position_offset"])
        caches = store.read(store.ids())
        fitted = fit_to_ratio(caches, weighted, cal.info["bits_per_element"] / 16, source=cal.info["source"])
        with open(args.out, "wb") as fh:
            fh.write(fitted.to_bytes())
        result["weighted"] = {"file": args.out, "bits": fitted.info["bits_per_element"],
                              "key_step": fitted.info["key_step"], "value_step": fitted.info["value_step"]}
        print(f"weighted calibration: {args.out}, {fitted.info['bits_per_element']:.3f} bits per element on its "
              f"passages (uniform: {cal.info['bits_per_element']:.3f}), steps {fitted.info['key_step']}/"
              f"{fitted.info['value_step']} times the layer steps")
    bc.emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
