"""The codec frontier: stored size against fidelity, from `codec_fidelity.py --json` outputs.

One panel per measure (KL(lossless || codec) and dNLL per gold-answer token, each with its
95% interval), the size as a fraction of raw bf16 KV on the x axis (log scale), one point per
codec and k. Several JSON files (runs of the same questions, e.g. scalar codecs in one run and
transform-coding probes in another) are drawn together.

    python benchmarks/codec_frontier.py RUN.json [RUN.json ...] --out docs/codec-frontier.png
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default="codec-frontier.png")
    return ap.parse_args(argv)


def points(runs: list[dict]) -> list[dict]:
    out = []
    for run in runs:
        for label, fig in run["codecs"].items():
            codec, k = label.split("@k=")
            out.append({"codec": codec, "k": int(k), "ratio": fig["ratio"], "kl": fig["kl"], "dnll": fig["dnll"],
                        "flips": fig["flips"]["share"]})
    return out


def draw(pts: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullFormatter

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "kl", "KL(lossless || codec), mean per position"),
                           (axes[1], "dnll", "dNLL per gold-answer token")):
        means = sorted(p[key]["mean"] for p in pts)
        # far worse codecs (k2v4: 40x the median) are drawn at the top edge, value written; the rest whole
        near = max(abs(means[len(means) // 2]), 1e-4) * 10
        top = 1.05 * max(p[key]["ci95"][1] for p in pts if p[key]["mean"] <= near)
        ax.set_ylim(min(0.0, means[0]) - 0.05 * top, top)
        for k, marker in ((3, "o"), (5, "s")):
            sel = [p for p in pts if p["k"] == k]
            for p in sel:
                lo, hi = p[key]["ci95"]
                mean = p[key]["mean"]
                if mean > top:
                    ax.plot(p["ratio"], top * 0.97, "^", color="tab:red")
                    ax.annotate(f"{p['codec']} ({mean:.2f}, off scale)", (p["ratio"], top * 0.97),
                                textcoords="offset points", xytext=(4, -10), fontsize=7)
                    continue
                color = "tab:blue" if p["codec"].startswith("tc:") else \
                    "tab:grey" if p["codec"].startswith("tc@") else "tab:orange"
                ax.errorbar(p["ratio"], mean, yerr=[[mean - lo], [hi - mean]], fmt=marker, color=color,
                            capsize=2, alpha=0.8)
                if k == 3:
                    ax.annotate(p["codec"], (p["ratio"], mean), textcoords="offset points", xytext=(4, 4),
                                fontsize=7)
        ax.set_xscale("log")
        # a narrow log range would label its minor ticks over each other: label fixed fractions only
        ratios = [p["ratio"] for p in pts]
        ticks = [t for t in (0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.8, 1.0)
                 if min(ratios) * 0.9 <= t <= max(ratios) * 1.1]
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_major_formatter(lambda x, _pos: f"{x:g}")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("stored bytes / raw bf16 KV (log)")
        ax.set_title(title, fontsize=10)
        ax.axvline(0.125, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    axes[0].text(0.127, axes[0].get_ylim()[1] * 0.9, "8x", fontsize=8, color="grey")
    fig.suptitle("Codec frontier (orange: scalar codecs; blue: the transform codec tc:KEY/VALUE steps; grey: the "
                 "numpy probe; o k=3, s k=5)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    runs = [json.load(open(path)) for path in args.runs]
    pts = points(runs)
    draw(pts, args.out)
    for p in sorted(pts, key=lambda p: (p["k"], p["ratio"])):
        print(f"k={p['k']} {p['codec']:>22} x{p['ratio']:.3f}  KL {p['kl']['mean']:.4f}  dNLL {p['dnll']['mean']:+.4f}"
              f"  flips {100 * p['flips']:.1f}%")
    print(json.dumps({"bench": "codec_frontier", "points": len(pts), "out": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
